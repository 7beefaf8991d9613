-- QSAC on qvg_int2's keys: QSAC is a final assignment, and qvg_int2's keys
-- take the labels of the last Lloyd step, which this file does not change
return {
  base = "qvg_int2",
  key = {
    qsac_candidates = 4,
  },
}
