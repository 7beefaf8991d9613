-- a long vararg list copied by every call
local t = {}
for i = 1, 100000 do t[i] = i end
local function count(...) return select("#", ...) end while true do count(table.unpack(t)) end
