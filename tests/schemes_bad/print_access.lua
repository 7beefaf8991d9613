-- no print
print("hello")
return {}
