-- no pattern matching: it can run for hours inside C, out of the hook's reach
local s = ("a"):rep(30)
local r = s:gsub(("a*"):rep(30) .. "b", "")
return {}
