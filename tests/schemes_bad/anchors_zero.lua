-- an anchor period of 0: leave anchors out to turn them off
return {
  anchors = { every = 0, bits = 8 },
}
