-- no collectgarbage
collectgarbage("stop")
return {}
