"""pdgate's gateway app served by granian instead of uvicorn, for ``pdgate bench compare``.

Measurement only: pdgate serves with uvicorn (httptools, uvloop), and this is how the
benchmark puts the same Starlette app behind granian (a Rust HTTP server with Python
workers, ``pip install granian``, not a pdgate dependency) to compare what the server costs
a request. It takes the arguments ``pdgate bench compare`` appends to a build's command
(``--log-level L gateway --host H --port 0 --registry-url URL``; the rest of the gateway's
settings come from the environment, as for ``pdgate gateway``), starts granian with one
worker on a free port, prints the ready line a ``pdgate gateway`` prints, and stays in the
foreground until granian exits. Static ``--prefill/--decode`` servers and ``--workers``
are not supported here.

    pdgate bench compare --pin \\
      --gateway 'uvicorn=python -m pdgate.config.cli' \\
      --gateway 'granian=python -m pdgate.loadtest.gateway_cost.granian_gateway'
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from starlette.types import ASGIApp

from pdgate.loadtest.lib.children import free_port

__all__ = ["app", "main"]


def app() -> ASGIApp:
    """The gateway app as ``pdgate gateway`` builds it, from the environment's settings (the
    factory granian's worker calls)."""
    from pdgate.config import GatewaySettings, RegistrySettings
    from pdgate.gateway.app import build_gateway_app
    from pdgate.gateway.cli import _settle_gc
    from pdgate.registry import open_registry

    settings = GatewaySettings.load(None)
    registry_settings = RegistrySettings.load(None)
    built = build_gateway_app(settings, open_registry(registry_settings), registry_settings)
    _settle_gc()  # as `pdgate gateway` does once serving: the comparison is of the servers
    return built


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="granian_gateway")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("command", choices=["gateway"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--registry-url")
    args = p.parse_args(argv)
    binary = shutil.which("granian") or os.path.join(os.path.dirname(sys.executable), "granian")
    if not os.path.exists(binary):
        print("granian not installed (pip install granian)", file=sys.stderr)
        return 2
    port = args.port or free_port()
    env = dict(os.environ)
    if args.registry_url:
        env["PDGATE_REGISTRY_URL"] = args.registry_url
    server = subprocess.Popen(
        [binary, "--interface", "asgi", "--factory", "--loop", "uvloop", "--workers", "1",
         "--host", args.host, "--port", str(port), "--log-level", args.log_level.lower(),
         "--no-access-log", "pdgate.loadtest.gateway_cost.granian_gateway:app"],
        env=env,
    )  # fmt: skip
    url = f"http://{args.host}:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                break
        except urllib.error.HTTPError:
            break  # serving (503 until instances register)
        except OSError:
            time.sleep(0.1)
    else:
        server.kill()
        print("granian did not start", file=sys.stderr)
        return 1
    print(f"pdgate gateway: {url}/v1", flush=True)
    # Stopped as a gateway is (SIGTERM, SIGINT): granian stops with it, never orphaned.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.terminate())
    return server.wait()


if __name__ == "__main__":
    sys.exit(main())
