-- stable_qvg_int2: the practitioner's pipeline over QVG's k-means smoothing: 256 centroids
-- a chunk, an INT2 residual in groups of 64 with FP8 E4M3 scale and zero, 2 outliers a row
-- kept exactly, 8-bit anchors every 11 chunks, and calibrated mixed precision (a table
-- measured with this scheme: `kvforge calibrate`). No error feedback, as stable_noef_int2:
-- it bought nothing measurable on the testbed (docs/QUALITY.md). Of the pipeline over a
-- k-means base this is the variant that measured better (QuantWM's keys carry PSAC, which
-- the pipeline does not take).
return {
  base = "qvg_int2",
  name = "stable_qvg_int2",
  key = { scale_format = "fp8" },
  value = { scale_format = "fp8" },
  outliers = { key = 2, value = 2 },
  anchors = { every = 11, bits = 8 },
  mixed_precision = { key_fraction = 0.1875, value_fraction = 0.0625, refine_bits = 2 },
}
