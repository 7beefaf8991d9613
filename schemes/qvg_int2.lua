-- qvg_int2: QVG (Quant VideoGen), docs/BACKGROUND.md section 4: per chunk and head, k-means
-- over the token vectors into C clusters; each token stores its centroid index and the
-- residual x - centroid quantized per token in groups of 64.
--
-- Where the settings come from:
--   centroids = 256        C = 256 in QVG's paper and kernels (docs/BACKGROUND.md section 4)
--                          and in QuantWM, which builds on it; a uint8 index per token, BF16
--                          centroids per head and span;
--   kmeans_iters = 2       QVG's Lloyd iterations for most models (its code);
--   kmeans_labels = "last_step"  as QVG's k-means returns them: each token keeps the label
--                          of the last Lloyd step and the centroids are the means of those
--                          clusters, so there is no final assignment (2 assignments, not 3;
--                          docs/METHODS.md section 3, measured in docs/QUALITY.md);
--   group_size = 64        QVG's residual groups of 64 channels of one token;
--   bits = 2, affine, FP16 scales: INT2 residual with scale and zero point (QVG's code
--                          has an asymmetric option with all four levels; its default symmetric
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
    kmeans_labels = "last_step",
    seed = 0,
  },
  value = {
    bits = 2,
    group_size = 64,
    mode = "affine",
    scale_format = "fp16",
    centroids = 256,
    kmeans_iters = 2,
    kmeans_labels = "last_step",
    seed = 0,
  },
}
