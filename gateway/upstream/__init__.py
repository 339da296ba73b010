"""Talking to instances: the `Upstream` protocol (`base`: prefill, prefill batch, decode
stream, KV release), its aiohttp implementation (`http`) and an in-memory one that behaves
as a cluster of pdgate shims (`mock`, for tests and benchmarks).

May import: errors, observe."""
