-- qvg7k_ternary: kvforge's best at QVG's byte budget (about 2.3 bits a value, 6.96x at a
-- span of 8 chunks, as qvg7_int2). QVG's layout (256 centroids a head over spans of 8
-- chunks, FP8 scales) with the bytes that ternary codes save on the values spent on the
-- keys: keys affine INT2 (four levels, an FP8 scale and zero) in groups of 32, values
-- ternary in groups of 64 (docs/FORMAT.md). On the world model's 16-chunk dump its
-- attention-output error is 0.40x qvg7_int2's at the same bytes (docs/QUALITY.md).
return {
  base = "qvg8_ternary",
  name = "qvg7k_ternary",
  key = { mode = "affine", group_size = 32 },
}
