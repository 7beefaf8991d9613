-- unknown top-level field
return {
  name = "unknown_top",
  colour = "blue",
}
