return { base = "rtn_int2", name = "rtn8s_int2", key = { scale_format = "fp8", group_size = 128, mode = "symmetric" }, value = { scale_format = "fp8", group_size = 128, mode = "symmetric" } }
