-- sorting a long array again and again: each call works inside C
local t = {}
for i = 1, 1000000 do t[i] = -i end
while true do table.sort(t) end
