-- recursion through a metamethod (C stack)
local t = setmetatable({}, { __index = function(self, k) return self[k] end })
return { head_dim = t.x }
