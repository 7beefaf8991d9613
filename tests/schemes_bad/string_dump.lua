-- no string.dump (bytecode)
local b = string.dump(function() end)
return {}
