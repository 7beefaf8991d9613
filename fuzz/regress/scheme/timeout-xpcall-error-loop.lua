-- nor can xpcall, whatever its handler eosd
local function handler(m) return m end
while true do
  xpcall(function() wndler(m)  do end end, handler)
end
