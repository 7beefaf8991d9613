-- qvg_int2: QVG (Quant VideoGen), SPEC.md section 3: per chunk and head, k-means over the
-- token vectors into C clusters; each token stores its centroid index and the residual
-- x - centroid quantized per token in groups of 64.
--
-- Where the settings come from:
--   centroids = 256        C = 256 in QuantWM's reproduction (SPEC.md section 3) and in
--                          QVG's kernels (ANCHORS.md); a uint8 index per token, BF16
--                          centroids per head and span;
--   kmeans_iters = 2       QVG's Lloyd iterations "for most models" (ANCHORS.md);
--   group_size = 64        "the residual is quantized per token in groups of 64";
--   bits = 2, affine, FP16 scales: INT2 residual with scale and zero point (ANCHORS.md's
--                          "asymmetric" option uses all four levels; QVG's default symmetric
--                          mode uses three) and FP16 instead of QVG's FP8 scales;
--   seed = 0               the k-means initialisation is seeded (docs/METHODS.md section 3),
--                          unlike QVG's, so runs are reproducible.
-- Keys and values alike; keys use the plain nearest centroid (QSAC is quantwm_int2).
return {
  base = "rtn_int2",
  name = "qvg_int2",
  key = {
    bits = 2,
    group_size = 64,
    mode = "affine",
    scale_format = "fp16",
    centroids = 256,
    kmeans_iters = 2,
    seed = 0,
  },
  value = {
    bits = 2,
    group_size = 64,
    mode = "affine",
    scale_format = "fp16",
    centroids = 256,
    kmeans_iters = 2,
    seed = 0,
  },
}
