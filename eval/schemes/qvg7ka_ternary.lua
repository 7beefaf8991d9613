-- At QVG's bytes with the keys given the most: keys affine INT2 (four levels, FP8 scale
-- and zero) in groups of 32, values ternary in groups of 128 (about 7.1x at a span of 8)
return { base = "qvg8_ternary", name = "qvg7ka_ternary", key = { mode = "affine", group_size = 32 },
         value = { group_size = 128 } }
