-- the library, exercised the way a real scheme might compute its fields
local function pick(t, k) return t[k] or error("no " .. tostring(k)) end
local bits = { int2 = 2, int4 = 4, int8 = 8 }
local parts = {}
table.insert(parts, "rtn")
table.insert(parts, string.format("int%d", pick(bits, "int4")))
table.sort(parts, function(x, y) return x > y end)
local name = table.concat(parts, "_"):upper():lower():reverse():reverse()
local ok, err = pcall(pick, bits, "int3")
local t = setmetatable({}, { __index = function(_, k) return #k end })
local g = select("#", table.unpack({ 1, 2, 3 })) * 16 + t.abcd * 4
local s = string.char(string.byte("abc", 1, 3)) .. tostring(ok) .. tonumber("12")
local p = table.pack(math.max(1, 2), math.min(3, 4), math.floor(2.5), math.type(1))
goto done
::done::
return {
  name = name:sub(1, 8) .. #s,
  key = { bits = pick(bits, "int4"), group_size = g // 1 },
  value = { bits = math.tointeger(p[1] * 2) or 2, mode = ok and "affine" or "symmetric" },
  chunk = { tokens = 3 * 1560, recent = p.n - 4 },
}
