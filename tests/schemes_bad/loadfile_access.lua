-- no loadfile
return loadfile("/etc/passwd")()
