-- ablation of stable_int2: the FP8 INT2 base with anchors alone
return { base = "rtn_int2", key = { scale_format = "fp8" }, value = { scale_format = "fp8" }, name = "abl_anc_int2", anchors = { every = 11, bits = 8 } }
