-- a memory bomb: one huge string
local s = string.rep("x", 1 << 30)
return { name = s }
