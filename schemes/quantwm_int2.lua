-- quantwm_int2: QuantWM (docs/BACKGROUND.md section 4), training-free and strictly causal,
-- built on QVG's centroids + INT2 residual (the base, qvg_int2), with:
--   key.qsac_candidates = 4  QSAC: each key chooses among its M = 4 nearest centroids (by
--                          the query-weighted distance) the one whose residual has the
--                          smallest query-weighted INT2 error (QuantWM uses M = 4; all 256
--                          candidates were 10x slower for no gain);
--   key.psac_rank = 8      PSAC: the key error projected on the top r = 8 eigenvectors of
--                          the queries' second-moment matrix, stored INT8 per token with
--                          an INT8 basis (one scale per head), kept only where it lowers
--                          e^T M e; values get none;
--   scale_format = "int8_fp16"  QuantWM's storage: INT8 group scales under an FP16 scale per
--                          token (a group pays one byte of scale), for keys and values;
--   key.kmeans_labels = "final"  QSAC is the keys' final assignment, against the final
--                          centroids (values keep QVG's labels of the last Lloyd step);
--   centroids 256, group 64, 2 k-means iterations: QVG's settings, which QuantWM builds on.
-- QSAC and PSAC read the layer's query statistics (kvf_qstats_*); without them (the first
-- chunk) QSAC uses w = 1 and PSAC stores nothing (docs/METHODS.md section 4).
return {
  base = "qvg_int2",
  name = "quantwm_int2",
  key = {
    qsac_candidates = 4,
    psac_rank = 8,
    scale_format = "int8_fp16",
    kmeans_labels = "final",
  },
  value = {
    scale_format = "int8_fp16",
  },
}
