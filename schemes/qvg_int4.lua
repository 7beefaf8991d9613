-- qvg_int4: QVG with a 4-bit residual (QVG quantizes the residual at 2 or 4 bits in groups
-- of 64: docs/BACKGROUND.md section 4). Everything else comes from qvg_int2.
return {
  base = "qvg_int2",
  name = "qvg_int4",
  key = { bits = 4 },
  value = { bits = 4 },
}
