return { base = "rtn_int2", name = "rtn8_int2", key = { scale_format = "fp8" }, value = { scale_format = "fp8" } }
