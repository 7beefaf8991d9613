-- ablation of stable_int2: the FP8 INT2 base with mixed precision alone
return { base = "rtn_int2", key = { scale_format = "fp8" }, value = { scale_format = "fp8" }, name = "abl_mix_int2", mixed_precision = { key_fraction = 0.1875, value_fraction = 0.0625, refine_bits = 2 } }
