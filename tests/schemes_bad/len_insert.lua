-- a __len of math.maxinteger: table.insert would shift 2^63 elements inside C
local t = setmetatable({}, { __len = function() return math.maxinteger end })
table.insert(t, 1, "x")
return {}
