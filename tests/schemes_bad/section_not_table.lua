-- a section that is not a table
return {
  head_dim = 128,
  rope = "pre",
}
