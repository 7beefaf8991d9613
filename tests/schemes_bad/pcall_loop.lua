-- pcall cannot catch the instruction limit
while true do
  pcall(function() while true do end end)
end
