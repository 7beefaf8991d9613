-- an integer field given a fraction
return {
  key = { group_size = 64.5 },
}
