-- quantwm7_int2: kvforge's best at QVG's byte budget: qvg7_int2's bytes (FP8 symmetric
-- INT2 residual, 256 centroids over spans of 8 chunks, about 2.3 bits a value) with
-- QuantWM's query-aware choice of each key's centroid (QSAC, 4 candidates), which costs
-- no byte. PSAC is left out: its coefficients (rank 8: 8 bytes a token and head) would
-- take the budget past QVG's.
return {
  base = "qvg7_int2",
  name = "quantwm7_int2",
  key = { qsac_candidates = 4, kmeans_labels = "final" },
}
