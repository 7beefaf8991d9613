-- pcall cannot catch the memory limit
local ok = pcall(string.rep, "x", 1 << 30)
return { head_dim = ok and 64 or 128 }
