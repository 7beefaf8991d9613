-- qvg7k_ternary with key groups of 64 (about 7.4x): affine keys need the smaller groups,
-- FP8's coarse zero point costs them more at 64 channels a group
return { base = "qvg8_ternary", name = "qvg7k64_ternary", key = { mode = "affine", group_size = 64 } }
