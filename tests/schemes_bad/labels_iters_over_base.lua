-- no Lloyd step over qvg_int2, whose keys take the labels of the last one
return {
  base = "qvg_int2",
  name = "no_steps",
  key = {
    kmeans_iters = 0,
  },
}
