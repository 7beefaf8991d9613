-- stable_noef_int2: stable_int2 without error feedback: outliers (2 a row kept exactly),
-- 8-bit anchors every 11 chunks, calibrated mixed precision over INT2 in groups of 64
-- with FP8 E4M3 scale and zero (docs/METHODS.md section 11).
-- Why a second pipeline scheme: on the testbed (docs/QUALITY.md, "The practitioner's
-- pipeline, measured") error feedback bought nothing measurable, in attention on a
-- teacher-forced dump or in pixels and flicker of an autoregressive rollout, while its
-- carried error (f32, one span a layer) costs two BF16 chunks of memory a layer. This is
-- the cheaper of the two; stable_int2 keeps the write-up's full recipe.
return {
  base = "stable_int2",
  name = "stable_noef_int2",
  error_feedback = { decay = 0 },
}
