-- rotation is "none" or "hadamard"
return {
  key = {
    bits = 2,
    rotation = "random",
  },
}
