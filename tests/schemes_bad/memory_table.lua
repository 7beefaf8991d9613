-- a memory bomb: a table that grows without end
local t = {}
local i = 0
while true do
  i = i + 1
  t[i] = i
end
