"""Conditional disaggregation across real processes: a gateway, a prefill and sim decodes
registering in a real Redis.

Short prompts, and prompts whose prefix a decode served, go straight to a decode that
declares local prefill (the response names it as both prefill and decode); long new ones go
through the prefill; a decode that does not declare it never gets a plain request; a 429 at
the decode falls back to prefill + decode. Greedy text is the same either way.
"""

from __future__ import annotations

import httpx
import orjson

from tests._cluster import SIM_MODEL, Processes, instances_by_id, shim_load, wait_for

THRESHOLD = 200
LONG = "A long system prompt that several requests share, with its rules spelled out. " * 8
SHORT = "Hi there."


def _complete(gw: str, prompt: str, *, stream: bool = False) -> tuple[str, str, str]:
    """(text, prefill id, decode id) of one request through the gateway."""
    body = {"model": SIM_MODEL, "prompt": prompt, "max_tokens": 10, "stream": stream}
    resp = httpx.post(gw + "/v1/completions", json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    if stream:
        events = [
            orjson.loads(line.removeprefix("data: "))
            for line in resp.text.splitlines()
            if line.startswith("data: {")
        ]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    else:
        text = resp.json()["choices"][0]["text"]
    return text, resp.headers["x-pdgate-prefill"], resp.headers["x-pdgate-decode"]


def _metric(gw: str, name: str, labels: str) -> float:
    for line in httpx.get(gw + "/metrics", timeout=5).text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.split()[-1])
    return 0.0


def test_short_and_cached_prompts_skip_the_prefill_across_processes(
    processes: Processes,
) -> None:
    gw = processes.gateway(env={"PDGATE_GATEWAY_LOCAL_PREFILL_MAX_UNCACHED_CHARS": str(THRESHOLD)})
    processes.shim("prefill", "--instance-id", "p-1")
    processes.shim("decode", "--instance-id", "d-local", "--capacity", "1")
    wait_for(
        lambda: set(instances_by_id(gw)) == {"p-1", "d-local"}, timeout=10, what="registration"
    )
    urls = {i: r["url"] for i, r in instances_by_id(gw).items()}

    # A long new prompt goes through the prefill; once d-local served it, its prefix is
    # cached there and the same prompt (and one that extends it) skips the prefill.
    disaggregated, prefill, decode = _complete(gw, LONG, stream=True)
    assert (prefill, decode) == ("p-1", "d-local")
    local, prefill, decode = _complete(gw, LONG, stream=True)
    assert (prefill, decode) == ("d-local", "d-local")
    assert local == disaggregated  # greedy: the same text either way
    assert _complete(gw, LONG)[0] == disaggregated  # and assembled for a non-streaming client
    assert _complete(gw, LONG + " And a question.")[1] == "d-local"
    assert _complete(gw, SHORT)[1:] == ("d-local", "d-local")
    assert shim_load(urls["p-1"])["admitted"] == 1
    assert shim_load(urls["d-local"])["local_prefills"] == 4

    # A decode that does not declare it: short prompts still go to d-local, and only the
    # prefill + decode path ever reaches d-plain.
    processes.shim("decode", "--instance-id", "d-plain", env={"PDGATE_SHIM_LOCAL_PREFILL": "0"})
    wait_for(lambda: "d-plain" in instances_by_id(gw), timeout=10, what="d-plain")
    urls = {i: r["url"] for i, r in instances_by_id(gw).items()}
    for i in range(4):
        assert _complete(gw, f"{SHORT} {i}")[1:] == ("d-local", "d-local")

    # d-local's only slot taken behind the gateway's back: its 429 sends the request through
    # the prefill, to d-plain.
    held = {"model": SIM_MODEL, "prompt": SHORT, "max_tokens": 5000, "stream": True}
    with httpx.stream("POST", urls["d-local"] + "/v1/completions", json=held, timeout=10) as hold:
        assert hold.status_code == 200
        lines = hold.iter_lines()  # kept: dropping the iterator would close the connection
        next(lines)
        text, prefill, decode = _complete(gw, SHORT + " again", stream=True)
        assert (prefill, decode) == ("p-1", "d-plain")
        assert text
    assert shim_load(urls["d-local"])["rejected"] == 1
    assert shim_load(urls["d-plain"])["admitted"] == 1
    assert shim_load(urls["d-plain"])["local_prefills"] == 0

    assert _metric(gw, "pdgate_local_prefill_total", 'outcome="local"') == 8
    assert _metric(gw, "pdgate_local_prefill_total", 'outcome="fallback"') == 1
    assert _metric(gw, "pdgate_local_prefill_total", 'outcome="skipped"') == 1
    assert _metric(gw, "pdgate_decode_attempts_total", 'result="client_error"') == 0
