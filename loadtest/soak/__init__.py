"""``pdgate bench soak``: the gateway's memory over a long steady run, as deployed."""
