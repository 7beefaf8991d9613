-- no load: code cannot be made from strings
local f = load("return 1")
return {}
