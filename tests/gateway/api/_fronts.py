"""A deployed stack for the Responses and Messages tests: a prefill shim, a decode shim and
two gateways, each its own ``pdgate`` process, on one Redis, with two client keys."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests._cluster import (
    Processes,
    Subprocess,
    get_instances,
    registry_env,
    shim_load,
    wait_for,
)
from tests._redis import delete_prefix

ALICE = "sk-alice-0123456789abcdef"
BOB = "sk-bob-0123456789abcdef01"


@dataclass
class Stack:
    gateways: list[str]
    prefill: str
    decode: str

    def legs(self) -> tuple[int, int]:
        """Calls the prefill and the decode completed so far (the KV the decode pulled from
        the prefill counts on the prefill)."""
        return shim_load(self.prefill)["completed"], shim_load(self.decode)["completed"]

    def kv_fetched(self) -> int:
        return int(shim_load(self.prefill)["kv_fetched"])

    def settled(self) -> None:
        """Nothing held at any gateway: no pending request, no stream or call counted."""
        for url in self.gateways:
            wait_for(
                lambda url=url: (
                    httpx.get(url + "/health", timeout=5).json()["pending"] == 0
                    and all(
                        r["open_streams"] == 0 and r["inflight"] == 0
                        for r in get_instances(url, "adm")
                    )
                ),
                10,
                f"{url} settled",
            )


@contextmanager
def front_stack(redis_url: str, tmp_path: Path, **gateway_env: str) -> Iterator[Stack]:
    prefix = f"pdgate-test:{uuid.uuid4().hex}"
    keys = tmp_path / "keys"
    keys.write_text(f"{ALICE} name=alice\n{BOB} name=bob\n")
    env = {
        **registry_env(redis_url, prefix),
        "PDGATE_GATEWAY_API_KEYS_FILE": str(keys),
        "PDGATE_GATEWAY_ADMIN_TOKEN": "adm",
        **gateway_env,
    }
    procs: list[Subprocess] = []
    try:
        processes = Processes(procs, env)
        processes.shim("prefill", "--capacity", "4")
        processes.shim("decode", "--capacity", "16")
        gateways = [processes.gateway(), processes.gateway()]
        for url in gateways:
            wait_for(lambda url=url: len(get_instances(url, "adm")) == 2, 15, "instances")
        yield Stack(
            gateways,
            _only(instance_urls_admin(gateways[0], "prefill")),
            _only(instance_urls_admin(gateways[0], "decode")),
        )
    finally:
        for p in procs:
            p.kill()
        delete_prefix(redis_url, prefix)


def instance_urls_admin(gateway: str, role: str) -> list[str]:
    return [row["url"] for row in get_instances(gateway, "adm") if row["role"] == role]


def _only(urls: list[str]) -> str:
    assert len(urls) == 1, urls
    return urls[0]
