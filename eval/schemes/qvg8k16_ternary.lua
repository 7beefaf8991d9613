-- qvg8_ternary with the bytes spent on the keys: key groups of 16 (four times the FP8
-- scales), values as qvg8_ternary (about 7.6x at a span of 8 chunks)
return { base = "qvg8_ternary", name = "qvg8k16_ternary", key = { group_size = 16 } }
