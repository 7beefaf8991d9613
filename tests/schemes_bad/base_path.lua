-- base is a name, not a path
return {
  base = "../schemes/rtn_int2",
}
