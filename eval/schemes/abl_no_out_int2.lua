-- ablation of stable_int2: all but outliers
return { base = "rtn_int2", key = { scale_format = "fp8" }, value = { scale_format = "fp8" }, name = "abl_no_out_int2", anchors = { every = 11, bits = 8 }, error_feedback = { decay = 0.7 }, mixed_precision = { key_fraction = 0.1875, value_fraction = 0.0625, refine_bits = 2 } }
