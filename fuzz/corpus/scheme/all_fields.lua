return { name = 'full', head_dim = 256,
 key = { bits = 4, group_size = 2^5, axis = 'channel', mode = 'symmetric',
  scale_format = 'int8_fp16', centroids = 256, kmeans_iters = 10, seed = 2^53,
  qsac_candidates = 4, psac_rank = 8, stages = 3 },
 value = { bits = 8, group_size = 16, axis = 'token', centroids = 16, stages = 2 },
 rope = { placement = 'post', layout = 'interleaved', theta = 1e6 },
 chunk = { tokens = 4096, span = 2, recent = 3, sink = 1 },
 outliers = false, anchors = nil, error_feedback = false, mixed_precision = false }
