"""``pdgate keys``: make client API keys and the lines of a keys file.

``pdgate keys new --name team-a --group chat --rpm 600`` prints a fresh key (give it to the
client) and the line for ``api_keys_file`` (which holds only its digest).
``pdgate keys hash`` reads a key on stdin (never on the command line: it would land in shell
history and ``ps``) and prints its line.
"""

from __future__ import annotations

import argparse
import secrets
import sys

from pdgate.gateway.admission.auth import digest

HELP = "make client API keys and keys-file lines"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["new", "hash"])
    p.add_argument("--name")
    p.add_argument("--group")
    p.add_argument("--rpm", type=int)
    p.add_argument("--priority", choices=["high", "normal", "low"])
    p.add_argument("--weight", type=float)


def line(key: str, args: argparse.Namespace) -> str:
    names = ("name", "group", "rpm", "priority", "weight")
    options = [f"{n}={v}" for n in names if (v := getattr(args, n))]
    return " ".join([f"sha256:{digest(key).hex()}", *options])


def main(args: argparse.Namespace) -> int:
    if args.rpm is not None and args.rpm <= 0:
        raise ValueError("--rpm must be positive")
    if args.action == "new":
        key = "sk-pdgate-" + secrets.token_urlsafe(32)
        print(f"key:  {key}")
        print(f"line: {line(key, args)}")
        return 0
    key = sys.stdin.readline().strip()
    if not key:
        raise ValueError("no key on stdin")
    print(line(key, args))
    return 0
