-- outlier separation is a later issue
return {
  head_dim = 128,
  outliers = { fraction = 0.01 },
}
