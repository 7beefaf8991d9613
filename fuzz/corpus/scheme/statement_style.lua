-- fields set one statement at a time
local cfg = {}
cfg.name = "stmt"
cfg.key = { bits = 4 }
cfg.value = {}
cfg.value.bits = 8
cfg.value["group_size"] = 32
cfg["chunk"] = { tokens = 1560, span = 3 }
return cfg
