-- the PSAC rank must be below head_dim
return {
  head_dim = 64,
  key = {
    psac_rank = 64,
  },
}
