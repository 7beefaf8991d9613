-- no require
local lfs = require("io")
return {}
