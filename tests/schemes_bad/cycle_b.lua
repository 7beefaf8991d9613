-- a cycle of bases: cycle_b -> cycle_a -> cycle_b
return {
  head_dim = 64,
  base = "cycle_a",
}
