-- stable_noef_int2's mechanisms (2 outliers a row, 8-bit anchors every 11 chunks, calibrated
-- mixed precision) over QVG's k-means smoothing (256 centroids a chunk) instead of plain RTN,
-- with the same FP8 affine group scales
return { base = "qvg_int2", name = "pipe_qvg_int2", key = { scale_format = "fp8" }, value = { scale_format = "fp8" },
  outliers = { key = 2, value = 2 }, anchors = { every = 11, bits = 8 },
  mixed_precision = { key_fraction = 0.1875, value_fraction = 0.0625, refine_bits = 2 } }
