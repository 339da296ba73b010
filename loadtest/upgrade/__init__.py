"""``pdgate bench upgrade``: a rolling restart of every prefill, decode and gateway under
steady streaming load, as deployed (separate processes, a private Redis); counts the client
requests that failed and the TTFT bump."""
