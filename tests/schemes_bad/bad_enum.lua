-- enum spelled wrong
return {
  key = {
    axis = "tokens",
  },
}
