-- out of range: 3-bit codes are not supported
return {
  key = {
    group_size = 64,
    bits = 3,
  },
}
