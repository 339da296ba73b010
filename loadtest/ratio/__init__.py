"""``pdgate bench ratio``: does following the gateway's P/D ratio advice (eq. 1 of P/D-Serve)
raise goodput? Unbalanced prefill:decode splits of one instance count, the advice read from
``GET /admin/ratio``, then the advised split, on a cluster deployed as separate processes."""
