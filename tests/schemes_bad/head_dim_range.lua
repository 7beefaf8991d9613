-- head_dim must be 64, 128 or 256
return {
  head_dim = 96,
}
