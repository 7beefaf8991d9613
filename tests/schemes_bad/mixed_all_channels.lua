-- refining every channel leaves none at the base precision
return {
  mixed_precision = { key_fraction = 0.99, table = "sens.json" },
}
