-- finalizers run with hooks off: refused
local t = setmetatable({}, { __gc = function() while true do end end })
return {}
