"""The `pdgate` command line: every subcommand takes the common flags, before or after."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from pdgate.config import cli
from pdgate.config.cli import COMMANDS, _parser
from tests._cluster import refused

# Positional arguments some commands need.
ARGS = {"keys": ["hash"]}


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - {"bench"}))
def test_common_flags_work_before_and_after_the_subcommand(command: str) -> None:
    extra = ARGS.get(command, [])
    after = [command, *extra, "--log-level", "WARNING", "--registry-url", "redis://h:1/0"]
    args = _parser(after).parse_args(after)
    assert (args.log_level, args.registry_url) == ("WARNING", "redis://h:1/0")
    before = ["--log-level", "ERROR", command, *extra]
    args = _parser(before).parse_args(before)
    assert args.log_level == "ERROR" and args.registry_url is None


def test_gateway_log_level_flag_is_accepted_by_the_real_command() -> None:
    """Issue 9: `pdgate gateway --log-level` was refused."""
    out = subprocess.run(
        [sys.executable, "-m", "pdgate.config.cli", "gateway", "--log-level", "DEBUG", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "--log-level" in out.stdout


def test_bad_settings_are_one_line_and_exit_2() -> None:
    out = refused(["gateway", "--prefill-policy", "fastest"], "unknown policy 'fastest'")
    assert out.stderr.startswith("pdgate gateway: unknown policy 'fastest'")


def test_http_client_libraries_log_no_line_per_request() -> None:
    """The official clients' HTTP libraries log each request at INFO: under the gateway's
    log level (INFO by default) a benchmark would write a line per request."""
    logging.getLogger("httpx").setLevel(logging.NOTSET)
    logging.root.setLevel(logging.INFO)
    cli._quiet_http_clients()
    for name in ("httpx", "httpx2", "openai"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO)
