-- ablation of stable_int2: the FP8 INT2 base with error feedback alone
return { base = "rtn_int2", key = { scale_format = "fp8" }, value = { scale_format = "fp8" }, name = "abl_ef_int2", error_feedback = { decay = 0.7 } }
