-- a section from a variable: the line falls back to the field that uses it
local k = { bits = 3 }
return {
  head_dim = 128,
  key = k,
}
