-- error() with a table
error({ code = 1 })
