-- nothing returned
local x = 1
