-- more QSAC candidates than centroids
return {
  key = {
    centroids = 2,
    qsac_candidates = 4,
  },
}
