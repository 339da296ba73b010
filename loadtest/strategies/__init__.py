"""``pdgate bench strategies``: aggregated, disaggregated and partial serving side by side."""
