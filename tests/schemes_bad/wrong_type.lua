-- wrong type: bits given as a string
return {
  value = {
    bits = "4",
  },
}
