--[==[ long comment with ]] and ]=] inside
]==]
local a, b = [[
two lines]], "esc\"aped\\ \x41\u{48}\z
      continued"
local n = 0x40 + 2^6 // 1 | 0 ~ 0 & 0xff << 0 >> 0
return {
  name = 'tok' .. #a % 10,  -- 'tok2'
  head_dim = n,
  ["key"] = { bits = 0x4, group_size = 64.0 },
  value = { mode = "symmetric", bits = 16 },
  rope = { theta = 1e4, layout = 'half' },
}
