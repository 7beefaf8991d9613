-- quarot_int2: QuaRot-style rotation, a baseline of docs/BACKGROUND.md section 4: keys and
-- queries multiplied by the same orthogonal Hadamard matrix along head_dim before
-- quantizing (attention logits do not change), then RTN.
--
-- Where the settings come from:
--   rotation = "hadamard"  for keys and values: the normalized Walsh-Hadamard transform
--                          of docs/METHODS.md section 5 spreads each token's outlier
--                          channels over all channels before quantizing; decode rotates
--                          back, so the caller's queries need no change;
--   the rest is rtn_int2 (the base): INT2, groups of 64 channels of one token, affine,
--                          FP16 scales: the RTN that QuaRot is compared with (LongCat-Video
--                          INT2: RTN 20.87 dB, QuaRot 21.57 dB; docs/BACKGROUND.md section 5).
return {
  base = "rtn_int2",
  name = "quarot_int2",
  key = { rotation = "hadamard" },
  value = { rotation = "hadamard" },
}
