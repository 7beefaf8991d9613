-- no dofile
return dofile("/etc/passwd")
