-- a cycle of bases: cycle_a -> cycle_b -> cycle_a
return {
  base = "cycle_b",
}
