-- no os library
os.execute("touch /tmp/kvforge_pwned")
return {}
