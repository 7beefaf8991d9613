-- per-channel groups (axis token) must tile the tokens quantized together
return {
  chunk = { tokens = 4680 },
  value = {
    axis = "token",
    group_size = 64,
  },
}
