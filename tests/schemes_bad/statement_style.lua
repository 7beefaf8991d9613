-- fields set by statements: lines still found
local s = {}
s.key = {}
s.key.bits = 2
s.value = {
  bitz = 4,
}
return s
