-- two long strings compared again and again: one instruction, 8 MiB of work each
local a = string.rep("x", 1 << 23)
local b = string.rep("x", 1 << 23)
while a == b do end
