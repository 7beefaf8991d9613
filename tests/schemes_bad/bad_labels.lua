-- an unknown label source
return {
  value = {
    centroids = 16,
    kmeans_labels = "nearest",
  },
}
