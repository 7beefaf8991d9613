-- seeds are 0..2^53
return {
  key = { centroids = 16, seed = -1 },
}
