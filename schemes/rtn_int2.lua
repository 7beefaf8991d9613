-- rtn_int2: round-to-nearest INT2, the plain baseline of docs/BACKGROUND.md section 4
-- (per-token groups of channels, affine, no smoothing).
--
-- Where the settings come from:
--   bits = 2            the project's target of about 2 bits a value (docs/BACKGROUND.md
--                       section 1), the INT2 column of every table the papers report;
--   group_size = 64     groups of 64 channels, as QVG and QuantWM (docs/BACKGROUND.md
--                       section 4), so head_dim 128 has two groups per token;
--   axis = "channel"    a group runs along the channels of one token (per-token RTN);
--   mode = "affine"     scale and zero point per group (docs/BACKGROUND.md section 3);
--   scale_format = "fp16"  one FP16 scale and one FP16 zero point per group;
--   centroids = 0       no smoothing: no k-means, no QSAC, no PSAC, one stage.
-- Keys and values are quantized the same way. head_dim 128 is the usual size of
-- the video models' heads (docs/BACKGROUND.md section 1). See docs/SCHEMES.md for every field.
return {
  name = "rtn_int2",
  head_dim = 128,
  key = {
    bits = 2,
    group_size = 64,
    axis = "channel",
    mode = "affine",
    scale_format = "fp16",
    centroids = 0,
  },
  value = {
    bits = 2,
    group_size = 64,
    axis = "channel",
    mode = "affine",
    scale_format = "fp16",
    centroids = 0,
  },
  rope = { placement = "none" },
}
