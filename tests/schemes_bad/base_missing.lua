-- base names a scheme that does not exist
return {
  base = "no_such_scheme",
}
