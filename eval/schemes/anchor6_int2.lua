return { base = "rtn_int2", name = "anchor6_int2", key = { scale_format = "fp8" }, value = { scale_format = "fp8" }, outliers = { key = 2, value = 2 }, anchors = { every = 12, bits = 8 } }
