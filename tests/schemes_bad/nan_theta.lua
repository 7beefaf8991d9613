-- NaN is not a number a scheme accepts
return {
  rope = { theta = 0/0 },
}
