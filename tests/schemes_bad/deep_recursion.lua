-- endless (non-tail) recursion
local function f(n) return 1 + f(n + 1) end
return { head_dim = f(1) }
