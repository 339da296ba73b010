"""What the gateway knows of each instance: its record, load and the leases that count it
(`tracker`), which prefill caches which prompt prefix (`affinity`), and ejection of failing
instances with the retry budget (`health`).

May import: errors, observe, upstream."""
