-- temporal anchors are a later issue: only nil or false now
return {
  anchors = true,
}
