-- an unknown assignment
return {
  key = {
    centroids = 16,
    assign = "approx",
  },
}
