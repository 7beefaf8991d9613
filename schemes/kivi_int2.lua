-- kivi_int2: KIVI, the LLM baseline of docs/BACKGROUND.md section 4: keys quantized per
-- channel (a group runs along tokens), values per token, and the most recent tokens kept
-- in full precision (a residual window).
--
-- Where the settings come from (KIVI's code, jy-yuan/KIVI; docs/BACKGROUND.md section 4):
--   key.axis = "token"     keys per channel: a group is one channel of 32 consecutive
--                          tokens, with its own FP16 scale and FP16 minimum;
--   group_size = 32        KIVI's G = 32, for keys (along tokens) and values (along
--                          channels); the last group of a span may be partial
--                          (docs/METHODS.md section 2);
--   mode = "affine"        KIVI's asymmetric min/max with an fp16 scale and min;
--   value.axis = "channel" values per token;
--   chunk.recent = 1       KIVI keeps a full-precision residual window (R = 128 tokens in
--                          the LLM code); here the window is the most recent chunk, which
--                          the caller keeps in BF16 until the next chunk arrives;
--   rope.placement = "post"  KIVI quantizes keys after RoPE: decode returns them as they are.
-- No smoothing, no rotation: what KIVI does. docs/BACKGROUND.md section 2 explains why
-- per-channel keys break on video KV at 2 bits (outlier channels change from token to token).
return {
  base = "rtn_int2",
  name = "kivi_int2",
  key = {
    bits = 2,
    axis = "token",
    group_size = 32,
    mode = "affine",
    scale_format = "fp16",
  },
  value = {
    bits = 2,
    axis = "channel",
    group_size = 32,
    mode = "affine",
    scale_format = "fp16",
  },
  rope = { placement = "post" },
  chunk = { recent = 1 },
}
