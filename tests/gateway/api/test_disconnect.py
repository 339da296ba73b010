"""A client that goes away frees every slot it held, promptly."""

from __future__ import annotations

import socket

import httpx
import orjson

from tests._cluster import ThreadedCluster, hold_prefill_slot, raw_post, shim_load


def _raw_stream_request(url: str, body: dict[str, object]) -> socket.socket:
    return raw_post(url, orjson.dumps(body))


def test_disconnect_mid_stream_frees_decode_and_prefill_slots() -> None:
    with ThreadedCluster(prefills=1, decodes=1, shim={"capacity": 2}) as c:
        assert c.info is not None
        sock = _raw_stream_request(
            c.url,
            {
                "model": "sim-llama-3.1-8b",
                "prompt": "long story",
                "max_tokens": 2000,
                "stream": True,
            },
        )
        received = b""
        while received.count(b"data: ") < 3:
            received += sock.recv(65536)
        assert b"200 OK" in received.split(b"\r\n")[0]
        decode = c.info.decode_urls[0]
        assert shim_load(decode)["used"] == 1
        sock.close()
        c.wait_for(lambda: shim_load(decode)["used"] == 0, timeout=3, what="decode slot freed")
        c.wait_for(
            lambda: shim_load(c.info.prefill_urls[0])["used"] == 0,
            timeout=3,
            what="prefill slot freed",
        )
        c.wait_for(lambda: all(r["open_streams"] == 0 for r in c.instances()), timeout=3)
        # Freed because the client left: the decode's stream was cut, not finished.
        load = shim_load(decode)
        assert (load["cancelled"], load["completed"]) == (1, 0), load


def test_disconnect_while_waiting_for_a_prefill_cancels_the_wait() -> None:
    with ThreadedCluster(prefills=1, decodes=1, shim={"capacity": 1, "kv_hold_timeout_s": 10}) as c:
        assert c.info is not None
        held = hold_prefill_slot(c.info.prefill_urls[0])
        sock = _raw_stream_request(
            c.url, {"model": "sim-llama-3.1-8b", "prompt": "waiting", "stream": True}
        )
        c.wait_for(
            lambda: httpx.get(c.url + "/health").json()["pending"] == 1, what="request waiting"
        )
        sock.close()
        c.wait_for(
            lambda: httpx.get(c.url + "/health").json()["pending"] == 0,
            timeout=3,
            what="wait cancelled",
        )
        assert all(r["open_streams"] == 0 and r["inflight"] == 0 for r in c.instances())
        # The slot we hold is still ours, the cancelled request took nothing.
        host = held["remote_host"]
        port = held["remote_port"]
        rid = held["remote_request_id"]
        assert httpx.delete(f"http://{host}:{port}/v1/kv/{rid}").status_code == 204
