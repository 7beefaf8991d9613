-- a runtime error: Lua's own message
local cfg = nil
return {
  head_dim = cfg.head_dim,
}
