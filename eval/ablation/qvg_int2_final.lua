-- Ablation: qvg_int2 with a final assignment against the final centroids (kmeans_labels =
-- "final") instead of the labels of the last Lloyd step (QVG's k-means, the shipped setting).
return { base = "qvg_int2", name = "qvg_int2_final", key = { kmeans_labels = "final" }, value = { kmeans_labels = "final" } }
