-- array items are not fields
return {
  128,
  head_dim = 128,
}
