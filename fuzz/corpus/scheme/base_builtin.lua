return { base = "rtn_int4", name = "from_base", key = { group_size = 32 },
  rope = { placement = "pre", theta = 500000 } }
