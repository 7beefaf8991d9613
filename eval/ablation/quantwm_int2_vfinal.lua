-- Ablation: QuantWM INT2 with a final assignment of the values against the final centroids
-- (kmeans_labels = "final"; the keys have one anyway: QSAC) instead of the last Lloyd step's labels.
return { base = "quantwm_int2", name = "quantwm_int2_vfinal", value = { kmeans_labels = "final" } }
