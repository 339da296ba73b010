"""``pdgate bench chaos``: one fault at a time under open-loop streaming load, and overload."""
