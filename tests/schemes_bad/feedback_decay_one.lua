-- a decay of 1 never forgets the carried error: it must be below 1
return {
  error_feedback = { decay = 1.0 },
}
