-- a section with a throwing metatable
local mt = { __index = function() error("__index ran") end }
return {
  key = setmetatable({ bits = 2 }, mt),
}
