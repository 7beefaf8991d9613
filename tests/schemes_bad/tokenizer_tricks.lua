-- comments and strings that look like fields do not confuse the line finder
--[[ value = { bits = 3 } ]]
local note = "value = { bits = 3 }"
local long = [==[
  value = { bits = 3 }
]==]
return {
  key = { bits = 2 }, -- value = { bits = 3 }
  value = {
    bits = 3,
  },
}
