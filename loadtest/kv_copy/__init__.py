"""``pdgate bench kv-copy``: the vLLM connector's copies between a paged KV cache and a buffer
file, on the CPU or a GPU (needs torch; nothing else imports it)."""
