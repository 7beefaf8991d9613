-- outlier separation is not implemented yet: only nil or false
return {
  head_dim = 128,
  outliers = { fraction = 0.01 },
}
