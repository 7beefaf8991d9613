-- qvg_pro_int2: QVG-Pro, QVG with progressive residual quantization (docs/BACKGROUND.md
-- section 4: the remaining error smoothed and subtracted again, stage after stage).
--
-- Where the settings come from: the reported QVG-Pro configuration (4 stages, groups of
-- 16, 5 iterations; docs/BACKGROUND.md section 5: 4.84x, key error 0.240, QVG's 0.375):
--   stages = 4             four rounds of k-means smoothing, each with its own 256
--                          centroids and index, then one INT2 quantization of the last
--                          residual (as QVG's prq.py; docs/METHODS.md section 1);
--   group_size = 16        smaller groups, more scales;
--   kmeans_iters = 5.
-- Everything else comes from qvg_int2.
return {
  base = "qvg_int2",
  name = "qvg_pro_int2",
  key = { stages = 4, group_size = 16, kmeans_iters = 5 },
  value = { stages = 4, group_size = 16, kmeans_iters = 5 },
}
