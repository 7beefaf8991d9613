-- "last_step" labels are those of the last Lloyd step: there must be one
return {
  key = {
    centroids = 16,
    kmeans_iters = 0,
    kmeans_labels = "last_step",
  },
}
