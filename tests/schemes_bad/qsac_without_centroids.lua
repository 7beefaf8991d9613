-- QSAC picks among centroids: none here
return {
  key = {
    qsac_candidates = 4,
  },
}
