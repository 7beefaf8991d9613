-- two-level scales are per token: not with per-channel groups
return {
  value = {
    axis = "token",
    group_size = 32,
    scale_format = "int8_fp16",
  },
}
