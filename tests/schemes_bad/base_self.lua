-- a scheme based on itself
return {
  base = "base_self",
}
