-- no debug library
debug.sethook()
return {}
