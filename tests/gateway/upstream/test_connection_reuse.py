"""The gateway keeps its connections to the instances: a finished decode stream goes back to
the pool instead of being closed. A new TCP connection per request costs both sides: it was
7% of the gateway's CPU under load when the relay stopped reading at ``[DONE]`` and closed
the stream. Real processes (sim shims and a gateway on a real Redis); a closed connection
stays in TIME_WAIT for a minute on the side that closed it, which is what is counted."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests._cluster import Processes, get_instances, wait_for

MODEL = "sim-llama-3.1-8b"


def _time_wait_to(port: int) -> int:
    """Closed connections to or from `port` still in TIME_WAIT (on whichever side closed
    first), in this network namespace."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            ports = {int(end.rsplit(":", 1)[1], 16) for end in (local, remote)}
            if state == "06" and port in ports:
                count += 1
    return count


@pytest.mark.parametrize("migrations", ["0", "2"], ids=["byte-relay", "parsed-relay"])
def test_sequential_requests_reuse_the_decode_connection(
    processes: Processes, migrations: str
) -> None:
    processes.shim("prefill")
    processes.shim("decode")
    url = processes.gateway(env={"PDGATE_GATEWAY_MAX_MIGRATIONS": migrations})
    wait_for(lambda: len(get_instances(url)) == 2, what="instances registered")
    decode = next(r["url"] for r in get_instances(url) if r["role"] == "decode")
    port = int(decode.rsplit(":", 1)[1])
    before = _time_wait_to(port)
    with httpx.Client(timeout=30) as client:
        for i in range(40):
            body = {"model": MODEL, "prompt": f"reuse {i}", "max_tokens": 4, "stream": i % 2 == 0}
            resp = client.post(url + "/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
    # Not one closed connection per request (a stray one may come from a health check).
    assert _time_wait_to(port) - before <= 2
