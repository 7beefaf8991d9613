-- RoPE base must be positive
return {
  rope = {
    placement = "pre",
    theta = -1,
  },
}
