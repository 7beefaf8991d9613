-- no io library
local f = io.open("/etc/passwd")
return {}
