-- qvg9_ternary: the smallest of QVG's layout: qvg8_ternary (256 centroids a head over
-- spans of 8 chunks, ternary residual, FP8 scales) with one scale a row (groups of 128):
-- about 1.86 bits a value (8.6x). On the world model's 16-chunk dump its attention-output
-- error is 1.07x qvg7_int2's at 0.81x the bytes (docs/QUALITY.md).
return {
  base = "qvg8_ternary",
  name = "qvg9_ternary",
  key = { group_size = 128 },
  value = { group_size = 128 },
}
