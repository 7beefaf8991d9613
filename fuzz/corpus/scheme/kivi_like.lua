return {
  name = "kivi_like",
  key = { bits = 2, axis = "token", group_size = 128, scale_format = "int8_fp16" },
  value = { bits = 2, axis = "channel", group_size = 32 },
  rope = { placement = "pre", layout = "interleaved", theta = 10000.5 },
  chunk = { tokens = 4096, span = 1 },
}
