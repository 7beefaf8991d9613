-- per-channel groups (axis token, KIVI) quantize the values themselves: no k-means
return {
  chunk = { tokens = 4096 },
  key = {
    axis = "token",
    centroids = 16,
    group_size = 32,
  },
}
