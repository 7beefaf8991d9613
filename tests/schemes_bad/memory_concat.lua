-- a memory bomb: a string that doubles
local s = "x"
while true do
  s = s .. s
end
