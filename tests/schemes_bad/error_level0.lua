-- error() without a position: the loader adds the line it was running
local n = 3
error("no position here", 0)
