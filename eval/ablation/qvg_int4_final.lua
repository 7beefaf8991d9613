-- Ablation: qvg_int4 with a final assignment against the final centroids (kmeans_labels =
-- "final") instead of the labels of the last Lloyd step (QVG's k-means, the shipped setting).
return { base = "qvg_int4", name = "qvg_int4_final", key = { kmeans_labels = "final" }, value = { kmeans_labels = "final" } }
