-- Ablation: QuantWM INT2 without PSAC, QSAC kept.
return { base = "quantwm_int2", name = "quantwm_int2_nopsac", key = { psac_rank = 0 } }
