-- qvg7_int2 (QVG's layout: 256 centroids a span of 8 chunks, symmetric INT2 residual, FP8 scales)
-- with groups of 128 and the row's largest residual kept exactly, keys and values: about QVG's size
return { base = "qvg7_int2", name = "qvg7o_int2", key = { group_size = 128 }, value = { group_size = 128 }, outliers = { key = 1, value = 1 } }
