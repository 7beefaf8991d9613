-- values get no PSAC (docs/BACKGROUND.md section 4, QuantWM)
return {
  key = { psac_rank = 8 },
  value = {
    psac_rank = 8,
  },
}
