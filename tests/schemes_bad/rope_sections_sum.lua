-- the RoPE sections must share out all head_dim / 2 frequency pairs
return {
  head_dim = 128,
  rope = {
    placement = "pre",
    sections = { 16, 24, 20 },
  },
}
