-- quarot_int2: QuaRot-style rotation, the baseline of SPEC.md section 3 ("multiply keys
-- and queries by the same orthogonal Hadamard matrix along head_dim before quantizing
-- (attention logits are unchanged by the rotation), then RTN").
--
-- Where the settings come from:
--   rotation = "hadamard"  for keys and values: the normalized Walsh-Hadamard transform
--                          of docs/METHODS.md section 5 spreads each token's outlier
--                          channels over all channels before quantizing; decode rotates
--                          back, so the caller's queries need no change;
--   the rest is rtn_int2 (the base): INT2, groups of 64 channels of one token, affine,
--                          FP16 scales, the RTN settings QuaRot is compared with in
--                          SPEC.md section 3 (LongCat-Video INT2: RTN 20.87, QuaRot 21.57 PSNR).
return {
  base = "rtn_int2",
  name = "quarot_int2",
  key = { rotation = "hadamard" },
  value = { rotation = "hadamard" },
}
