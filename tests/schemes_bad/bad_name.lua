-- names are [A-Za-z0-9_] only
return {
  name = "rtn-int2",
}
