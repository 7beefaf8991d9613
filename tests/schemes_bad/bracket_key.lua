-- ["key"] = { ... } form
return {
  ["key"] = {
    ["bits"] = 5,
  },
}
