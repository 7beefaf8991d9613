-- ternary packs the codes of a row: not KIVI's groups along tokens
return {
  value = {
    axis = "token",
    mode = "ternary",
  },
}
