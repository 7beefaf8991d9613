-- ablation of stable_int2: all but error feedback
return { base = "rtn_int2", key = { scale_format = "fp8" }, value = { scale_format = "fp8" }, name = "abl_no_ef_int2", outliers = { key = 2, value = 2 }, anchors = { every = 11, bits = 8 }, mixed_precision = { key_fraction = 0.1875, value_fraction = 0.0625, refine_bits = 2 } }
