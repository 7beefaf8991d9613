-- quantwm_int4: QuantWM (quantwm_int2, the base) with 4-bit residual codes for keys and
-- values; QSAC, PSAC, two-level scales and the centroids are unchanged.
return {
  base = "quantwm_int2",
  name = "quantwm_int4",
  key = { bits = 4 },
  value = { bits = 4 },
}
