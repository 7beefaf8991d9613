-- found by fuzz_scheme (a timeout): each error costs far more inside C (the
-- message, the handler, the unwinding) than the few instructions it counts
local function handler(m) return m end
while true do xpcall(function() undefined_function() end, handler) end
