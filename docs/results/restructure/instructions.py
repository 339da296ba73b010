"""Machine instructions per request of pdgate's in-process hot path, counted by valgrind.

    python docs/results/restructure/instructions.py                      # this checkout
    PYTHONPATH=/tmp/before_root python docs/results/restructure/instructions.py  # another

(``/tmp/before_root/pdgate/<package>`` linked to another checkout's folders makes its
``pdgate`` the one imported.) Timing a few percent apart on a shared two-core machine is
noise; instructions are not: valgrind's callgrind counts every one. The script runs the
hot-path driver (loadtest/gateway_cost/_asgi.py: pdgate's ASGI app over the in-memory
upstream, two prefills and two decodes, eight concurrent streaming requests of 16 tokens)
under callgrind twice, with 100 and 600 measured requests after the same 400 of warm-up, and
prints the difference over 500: the instructions of one request, start-up cancelled out.

``--same-mock`` gives this checkout's in-memory upstream the older one's decode open (no
``asyncio.timeout`` around it): only the gateway's own code then differs between builds.
``--no-drain`` turns off drain admission and the loop-lag timer (settings the older build
lacks). Needs ``valgrind`` (Debian's package); about a minute and a half per build.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile

_WARMUP = 400
_COUNTS = (100, 600)


def _child(n: int) -> None:
    import orjson

    from pdgate.config import GatewaySettings, RegistrySettings, Role
    from pdgate.config.wire import EXT_BATCH_PREFILL, EXT_CONTINUATION, EXT_QUEUELESS
    from pdgate.gateway.app import build_gateway_app
    from pdgate.loadtest.gateway_cost import hotpath
    from pdgate.loadtest.gateway_cost._asgi import Lifespan, requests
    from pdgate.registry import open_registry
    from pdgate.registry.base import InstanceRecord

    try:
        from pdgate.gateway.upstream import mock
    except ImportError:  # before the split by stage
        from pdgate.gateway import mock_upstream as mock  # type: ignore[no-redef]

    if os.environ.get("PDGATE_SAME_MOCK"):

        async def plain_open(self, call, connect_timeout_s):  # type: ignore[no-untyped-def]
            reply = await self._answer(call)
            if reply.status != 200:
                return reply.status, orjson.dumps(reply.json or {})
            return mock._MockStream(call.url + call.path, reply)

        mock.MockUpstream._open = plain_open  # type: ignore[method-assign]

    async def run() -> None:
        registry = open_registry(RegistrySettings())
        extensions = {
            Role.PREFILL: (EXT_BATCH_PREFILL, EXT_QUEUELESS),
            Role.DECODE: (EXT_CONTINUATION,),
        }
        for role, ext in extensions.items():
            for i in range(2):
                name = f"{role.value}{i}"
                record = InstanceRecord(
                    id=name, role=role, url=f"http://{name}", model=hotpath._MODEL,
                    capacity=1024, extensions=ext,
                )  # fmt: skip
                await registry.put(record, ttl_s=3600)
        upstream = mock.MockUpstream(hotpath._handler(16), record=False)
        app = build_gateway_app(GatewaySettings.load(), registry, RegistrySettings(),
                                upstream=upstream)  # fmt: skip
        body = orjson.dumps({"model": hotpath._MODEL, "prompt": "hello world " * 8,
                             "max_tokens": 16, "stream": True, "temperature": 0})  # fmt: skip
        async with Lifespan(app) as state:
            await requests(app, state, body, _WARMUP, 8)
            await requests(app, state, body, n, 8)
        await registry.aclose()

    asyncio.run(run())


def _instructions(n: int, env: dict[str, str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out",
             sys.executable, __file__, "--child", str(n)],
            capture_output=True, text=True, env=env, check=True,
        )  # fmt: skip
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise SystemExit("valgrind printed no instruction count:\n" + out.stderr[-2000:])
    return int(found.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--same-mock", action="store_true")
    p.add_argument("--no-drain", action="store_true")
    args = p.parse_args()
    if args.child is not None:
        _child(args.child)
        return
    env = dict(os.environ)
    if args.same_mock:
        env["PDGATE_SAME_MOCK"] = "1"
    if args.no_drain:
        env["PDGATE_GATEWAY_DRAIN_ADMISSION"] = "false"
        env["PDGATE_GATEWAY_LOOP_LAG_INTERVAL_S"] = "0"
    low, high = (_instructions(n, env) for n in _COUNTS)
    per = (high - low) / (_COUNTS[1] - _COUNTS[0])
    print(
        f"{per:,.0f} instructions per request ({low:,} at {_COUNTS[0]}, {high:,} at {_COUNTS[1]})"
    )


if __name__ == "__main__":
    main()
