-- temporal anchors are not implemented yet: only nil or false
return {
  anchors = true,
}
