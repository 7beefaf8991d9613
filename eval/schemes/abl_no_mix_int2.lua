-- ablation of stable_int2: all but mixed precision
return { base = "rtn_int2", key = { scale_format = "fp8" }, value = { scale_format = "fp8" }, name = "abl_no_mix_int2", outliers = { key = 2, value = 2 }, anchors = { every = 11, bits = 8 }, error_feedback = { decay = 0.7 } }
