"""``pdgate bench instructions``: machine instructions per request of the in-process hot path,
counted by valgrind.

    pdgate bench instructions                                  # this checkout
    PYTHONPATH=/tmp/before_root pdgate bench instructions      # another build

(``/tmp/before_root/pdgate/<package>`` linked to another checkout's folders makes its
``pdgate`` the one the counted process imports; this module is run by its path, so only
`pdgate bench hotpath`'s driver must exist there.) Timing a few percent apart on a shared
two-core machine is noise; instructions are not: valgrind's callgrind counts every one. It
runs `pdgate bench hotpath`'s driver (pdgate's ASGI app over the in-memory upstream, two
prefills and two decodes, eight concurrent streaming requests of 16 tokens) under callgrind
twice, with 100 and 600 measured requests after the same 400 of warm-up, and prints the
difference over 500: the instructions of one request, start-up cancelled out.

``--same-mock`` gives this checkout's in-memory upstream the older one's decode open (no
``asyncio.timeout`` around it): only the gateway's own code then differs between builds.
``--no-drain`` turns off drain admission and the loop-lag timer (settings the older build
lacks). Needs ``valgrind`` (Debian's package).
"""

from __future__ import annotations

# Nothing of pdgate's is imported at the top: the counted process runs this file by its path
# in whichever environment PYTHONPATH names, and imports that build's modules.
import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile

__all__ = ["COUNTS", "WARMUP", "counted_argv", "instructions_per_request"]

WARMUP = 400
COUNTS = (100, 600)


def _child(n: int) -> None:
    import orjson

    from pdgate.loadtest.gateway_cost.hotpath import HotpathPlan, run_hotpath

    try:
        from pdgate.gateway.upstream import mock
    except ImportError:  # before the split by stage
        from pdgate.gateway import mock_upstream as mock  # type: ignore[attr-defined,no-redef]

    if os.environ.get("PDGATE_SAME_MOCK"):

        async def plain_open(self, call, connect_timeout_s):  # type: ignore[no-untyped-def]
            reply = await self._answer(call)
            if reply.status != 200:
                return reply.status, orjson.dumps(reply.json or {})
            return mock._MockStream(call.url + call.path, reply)

        mock.MockUpstream._open = plain_open  # type: ignore[method-assign]

    # One round: its clock reads and collections are the same at either count and cancel out.
    plan = HotpathPlan(requests=n, concurrency=8, rounds=1, tokens=16, warmup=WARMUP)
    asyncio.run(run_hotpath(plan))


def counted_argv(n: int) -> list[str]:
    """The counted process: warm-up and `n` requests. It runs this file by its path, not as
    a module, so that the build PYTHONPATH names need not have it."""
    run_file = f"import runpy; runpy.run_path({os.path.abspath(__file__)!r}, run_name='__main__')"
    return [sys.executable, "-c", run_file, "--child", str(n)]


def _instructions(n: int, env: dict[str, str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out", *counted_argv(n)],
            capture_output=True, text=True, env=env, check=True,
        )  # fmt: skip
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise RuntimeError("valgrind printed no instruction count:\n" + out.stderr[-2000:])
    return int(found.group(1))


def instructions_per_request(*, same_mock: bool, no_drain: bool) -> str:
    """The report line: instructions per request, and the two counts it comes from."""
    env = dict(os.environ)
    if same_mock:
        env["PDGATE_SAME_MOCK"] = "1"
    if no_drain:
        env["PDGATE_GATEWAY_DRAIN_ADMISSION"] = "false"
        env["PDGATE_GATEWAY_LOOP_LAG_INTERVAL_S"] = "0"
    low, high = (_instructions(n, env) for n in COUNTS)
    per = (high - low) / (COUNTS[1] - COUNTS[0])
    return f"{per:,.0f} instructions per request ({low:,} at {COUNTS[0]}, {high:,} at {COUNTS[1]})"


if __name__ == "__main__":  # the counted process
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", type=int, required=True)
    _child(parser.parse_args().child)
