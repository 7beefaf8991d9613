-- no name field, and the file name is not a valid scheme name
return {
  head_dim = 128,
}
