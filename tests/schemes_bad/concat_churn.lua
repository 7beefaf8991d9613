-- a long string copied again and again: one instruction, 8 MiB of work each
local s = string.rep("x", 1 << 23)
while true do local t = s .. "y" end
