-- qvg8_ternary (QVG's layout, ternary codes) with groups of 32: the bytes ternary saves
-- spent on twice the FP8 scales, keys and values (about 7.8x at a span of 8 chunks)
return { base = "qvg8_ternary", name = "qvg8g32_ternary", key = { group_size = 32 }, value = { group_size = 32 } }
