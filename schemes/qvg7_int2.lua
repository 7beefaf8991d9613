-- qvg7_int2: what QVG's own code stores, byte for byte (docs/BACKGROUND.md, the peer):
-- 256 centroids a head over a span of several chunks, a uint8 index a token, and the
-- residual symmetric INT2 (three levels) in groups of 64 with one FP8 E4M3 scale a
-- group: 32 code bytes, 2 scale bytes and 1 index byte a token and head at head_dim
-- 128, plus the span's BF16 centroids. At a span of 8 chunks of 4680 tokens that is
-- about 2.3 bits a value (6.9x), QVG's shipped operating point.
--
-- Where the settings come from:
--   scale_format = "fp8", mode = "symmetric"  QVG's default quantizer (its asymmetric
--                          option adds an FP8 zero a group);
--   chunk.span = 8         QVG quantizes a span of several chunks at once (8 in its
--                          Self-Forcing integration); a chunk waits in BF16 until its
--                          span is complete, as there;
--   the rest as qvg_int2   256 centroids, 2 Lloyd iterations, the last step's labels,
--                          groups of 64, a seeded k-means (QVG's is not seeded).
return {
  base = "qvg_int2",
  name = "qvg7_int2",
  key = { scale_format = "fp8", mode = "symmetric" },
  value = { scale_format = "fp8", mode = "symmetric" },
  chunk = { span = 8 },
}
