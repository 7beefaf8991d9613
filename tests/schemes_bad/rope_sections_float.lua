-- section sizes are counts of frequency pairs: integers >= 1
return {
  rope = { placement = "pre", sections = { 32.5, 31.5 } },
}
