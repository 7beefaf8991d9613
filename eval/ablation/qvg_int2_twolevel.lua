-- Ablation (docs/QUALITY.md): QVG INT2 with QuantWM's two-level int8/fp16 scales,
-- no QSAC, no PSAC: separates the scale format from QuantWM's two methods.
return { base = "qvg_int2", name = "qvg_int2_twolevel",
         key = { scale_format = "int8_fp16" }, value = { scale_format = "int8_fp16" } }
