-- qvg8_ternary: qvg7_int2 (QVG's own layout: 256 centroids a head over spans of 8
-- chunks, a symmetric INT2 residual in groups of 64 with FP8 E4M3 scales) with the
-- residual's three levels stored as they are: 8 codes in a 13-bit field instead of
-- 16 bits (mode = "ternary", docs/FORMAT.md). The same values as qvg7_int2, bit for
-- bit; 26 code bytes a token and head instead of 32 at head_dim 128: about 1.9 bits
-- a value (8.3x) where qvg7_int2 takes 2.3 (6.96x).
return {
  base = "qvg7_int2",
  name = "qvg8_ternary",
  key = { mode = "ternary" },
  value = { mode = "ternary" },
}
