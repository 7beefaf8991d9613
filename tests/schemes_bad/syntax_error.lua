-- a syntax error: Lua's own message
return {
  head_dim = 128
  key = { bits = 2 },
}
