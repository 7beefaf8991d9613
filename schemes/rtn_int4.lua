-- rtn_int4: round-to-nearest INT4, the RTN baseline of docs/BACKGROUND.md section 4 with 4-bit
-- codes (two per byte) for keys and values. Everything else (groups of 64 channels
-- of one token, affine, FP16 scales, no smoothing) comes from rtn_int2 through
-- `base`: only the fields that differ are written here.
return {
  base = "rtn_int2",
  name = "rtn_int4",
  key = { bits = 4 },
  value = { bits = 4 },
}
