-- a valid file whose base is broken: the message names the base file
return {
  base = "bits_range",
  head_dim = 128,
}
