"""pdgate's benchmarks and load tests, one subpackage per suite over one shared library.

* ``lib/``: what every suite uses (child processes, the SSE client, statistics, probes of
  the servers, a private Redis, a cluster deployed as separate processes, RSS sampling);
* ``scheduling/``: ``pdgate bench scheduling``, the P/D-Serve Fig. 14a experiment;
* ``gateway_cost/``: ``pdgate bench gateway`` and ``pdgate bench profile``, what the gateway
  itself costs, and the batch-endpoint comparison;
* ``soak/``: ``pdgate bench soak``, the gateway's memory over a long steady run;
* ``kv_copy/``: ``pdgate bench kv-copy``, the vLLM connector's KV copies (needs torch);
* ``summary/``: ``pdgate bench summary``, tables drawn from the scheduling CSVs;
* ``locust/``: Locust users, load shapes and workload (``make loadtest``).

``bench.py`` is the ``pdgate bench`` command; ``embedded.py`` is ``pdgate up`` (here because it
depends on both the gateway and the shim package, which never import each other).
"""
