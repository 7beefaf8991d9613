-- BF16 (bits 16) keeps values as they are: no centroids
return {
  key = {
    bits = 16,
    centroids = 256,
  },
}
