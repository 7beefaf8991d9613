-- Ablation: QuantWM INT2 without QSAC (plain nearest centroid), PSAC kept.
return { base = "quantwm_int2", name = "quantwm_int2_noqsac", key = { qsac_candidates = 1 } }
