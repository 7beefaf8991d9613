-- out of range: a chunk needs at least one token
return {
  chunk = { span = 1,
            tokens = 0 },
}
