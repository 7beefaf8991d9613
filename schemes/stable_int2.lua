-- stable_int2: the practitioner's temporally stable 2-bit pipeline (docs/BACKGROUND.md,
-- the practitioner's write-up; docs/METHODS.md section 11) over an INT2 base:
--   outliers = 2 a row        the 2 values of largest magnitude of each token's 128
--                             channels (1.6%; the write-up: 1-3%) kept exactly (BF16 and
--                             their channel), the groups' ranges taken from the rest;
--   anchors every 11 chunks   one chunk in 11 (33 frames; the write-up: every 32 frames)
--                             stored at 8 bits, the chunks between coded as their
--                             difference from it, token by token;
--   error_feedback 0.7        decay times the previous chunk's error at the same token
--                             added before quantizing (the write-up: 0.6-0.8);
--   mixed_precision           the 24 key channels (18.75%; the write-up: 15-20%) and 8
--                             value channels of each head that a calibration ranks highest
--                             get 2 more bits (a refinement of their residual); the table
--                             is the model's own: `kvforge calibrate` writes it, and the
--                             cache or `kvforge eval --table` is given it.
-- The base: INT2, groups of 64, affine, FP8 E4M3 scale and zero (a byte each a group).
return {
  base = "rtn_int2",
  name = "stable_int2",
  key = { scale_format = "fp8" },
  value = { scale_format = "fp8" },
  outliers = { key = 2, value = 2 },
  anchors = { every = 11, bits = 8 },
  error_feedback = { decay = 0.7 },
  mixed_precision = { key_fraction = 0.1875, value_fraction = 0.0625, refine_bits = 2 },
}
