"""What the gateway itself costs: ``pdgate bench gateway`` (added latency, throughput, CPU and
memory per stream next to vllm-router and no router), ``pdgate bench profile`` (py-spy),
``pdgate bench compare`` (gateway builds side by side at the same rates), ``pdgate bench
hotpath`` (pdgate's own CPU per request, in process) and the batch-endpoint comparison
(``python -m pdgate.loadtest.gateway_cost.batch_endpoint``)."""
