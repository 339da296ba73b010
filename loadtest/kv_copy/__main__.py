"""``python -m pdgate.loadtest.kv_copy``: ``pdgate bench kv-copy`` where only torch and pdgate's
engine_shim, config and loadtest folders are on the path (a lent GPU machine)."""

from __future__ import annotations

import argparse
import shlex
import sys

from pdgate.loadtest.kv_copy import command

parser = argparse.ArgumentParser(prog="python -m pdgate.loadtest.kv_copy", description=__doc__)
command.configure(parser)
sys.exit(command.main(parser.parse_args(), shlex.join(sys.argv)))
