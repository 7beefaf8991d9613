-- progressive stages need centroids
return {
  value = {
    stages = 2,
  },
}
