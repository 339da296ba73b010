"""``pdgate bench summary``: tables drawn from the CSVs other benchmarks wrote."""
