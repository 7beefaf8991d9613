-- a scheme returns a table
return 42
