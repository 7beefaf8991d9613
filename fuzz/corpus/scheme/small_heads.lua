return { name = "d64_sym", head_dim = 64,
  key = { bits = 8, mode = "symmetric", group_size = 16 },
  value = { bits = 4, group_size = 64 } }
