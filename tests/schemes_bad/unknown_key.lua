-- unknown field inside a section (a typo of key.bits)
return {
  head_dim = 128,
  key = {
    bitz = 2,
  },
}
