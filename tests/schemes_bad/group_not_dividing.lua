-- per-token groups must tile head_dim
return {
  head_dim = 64,
  key = {
    group_size = 128,
  },
}
