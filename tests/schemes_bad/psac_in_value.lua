-- values get no PSAC (SPEC.md section 3, QuantWM)
return {
  key = { psac_rank = 8 },
  value = {
    psac_rank = 8,
  },
}
