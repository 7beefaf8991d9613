-- the last Lloyd step's labels for quantwm_int2's keys, which QSAC assigns
return {
  base = "quantwm_int2",
  name = "wm_last",
  key = {
    kmeans_labels = "last_step",
  },
}
