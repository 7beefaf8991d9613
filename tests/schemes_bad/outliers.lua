-- outliers take a count per token row for key and value, not a fraction
return {
  head_dim = 128,
  outliers = { fraction = 0.01 },
}
