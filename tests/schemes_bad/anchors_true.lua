-- anchors are a table: { every = N, bits = 4 | 8 | 16 }
return {
  anchors = true,
}
