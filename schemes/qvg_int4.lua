-- qvg_int4: QVG with a 4-bit residual (SPEC.md section 3: "the residual is quantized per
-- token in groups of 64 (INT2 or INT4)"). Everything else comes from qvg_int2.
return {
  base = "qvg_int2",
  name = "qvg_int4",
  key = { bits = 4 },
  value = { bits = 4 },
}
