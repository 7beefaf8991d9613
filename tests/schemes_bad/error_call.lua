-- error() with a message
local n = 3
error("custom failure " .. n)
