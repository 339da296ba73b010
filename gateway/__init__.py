"""The gateway: an OpenAI-compatible front for prefill/decode-disaggregated serving.

Folders by stage of a request, lowest first; each imports only the ones above it in this
list (tests/test_layering.py checks it):

errors.py     the exception tree: every client-facing failure and its OpenAI error body
observe/      what the gateway records: Prometheus metrics, P/D ratio advice, request series
upstream/     talking to instances: the `Upstream` protocol, its HTTP client, an in-memory mock
instances/    what is known of each instance: load and leases, prefix affinity, ejection
admission/    who is asking and where they may go: API keys, tenants, scenario groups
placement/    choosing a prefill and a decode: queue, batch forming, forwarding, fleet leases
stream/       the client's answer: relaying the decode's stream, failover and migration
translate/    the other client APIs (Responses, Anthropic Messages) as chat requests and back
api/          the HTTP surface: completions, admin, the dashboard

app.py        the composition root: builds every part once and hands it down
cli.py        ``pdgate gateway``; workers.py runs several worker processes; keys.py ``pdgate keys``

The life of a request, step by step, is in api/completions.py and docs/architecture.md.
"""
