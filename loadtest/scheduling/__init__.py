"""``pdgate bench scheduling``: on-demand forwarding vs the paper's baseline (P/D-Serve Fig. 14a)
on one simulated cluster, in-process or deployed as separate processes."""
