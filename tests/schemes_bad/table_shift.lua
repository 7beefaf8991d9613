-- table.insert at the front of a long array shifts all of it inside C
local t = {}
for i = 1, 1000000 do t[i] = i end
while true do table.insert(t, 1, 0) table.remove(t, 1) end
