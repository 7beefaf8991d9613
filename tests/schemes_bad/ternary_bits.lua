-- ternary packs the three levels of symmetric INT2: no other width
return {
  key = {
    mode = "ternary",
    bits = 4,
  },
}
