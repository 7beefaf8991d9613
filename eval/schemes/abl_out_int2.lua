-- ablation of stable_int2: the FP8 INT2 base with outliers alone
return { base = "rtn_int2", key = { scale_format = "fp8" }, value = { scale_format = "fp8" }, name = "abl_out_int2", outliers = { key = 2, value = 2 } }
