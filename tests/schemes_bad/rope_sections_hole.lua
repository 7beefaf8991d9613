-- rope.sections is an array: no holes, no names
return {
  rope = {
    sections = { 32, nil, 32 },
  },
}
