"""``pdgate plan``: size a heterogeneous P/D fleet from a workload, SLOs and GPU offers."""
