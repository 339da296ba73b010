"""The operator's page, ``GET /dashboard``: behind the admin token (Bearer, or Basic with the
token as password, which is what a browser can send), with its security headers, and drawn in
a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``, installed by
``make debs``) driven by selenium against a running cluster. The browser must see every
instance, see the counts move while streaming load runs and fall back when it stops, load
nothing from another origin and report no console errors (a CSP violation is one).

The screenshot taken under load is checked here; ``PDGATE_UPDATE_DOCS=1`` (``make docs``)
also writes it to ``docs/dashboard.png``, so an ordinary test run never rewrites a file in the
checkout.
"""

from __future__ import annotations

import base64
import os
import re
import struct
import threading
import tomllib
from collections.abc import Iterator
from fnmatch import fnmatch
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver

from pdgate.gateway.admission.auth import ADMIN_CHALLENGE
from tests._cluster import ThreadedCluster, wait_for
from tests._tools import require_binary

ROOT = Path(__file__).resolve().parents[3]
STATIC = ROOT / "gateway" / "api" / "static"
DOCS_SCREENSHOT = ROOT / "docs" / "dashboard.png"
ADMIN = "adm-dashboard"
MODEL = "sim-llama-3.1-8b"
WIDTH, HEIGHT = 1280, 800


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# -- the page over HTTP ----------------------------------------------------------------------


def test_the_page_needs_the_admin_token_as_bearer_or_basic() -> None:
    with ThreadedCluster(prefills=1, decodes=1, gateway={"admin_token": ADMIN}) as c:
        page = c.url + "/dashboard"
        for refused in (
            {},
            {"authorization": _basic("ops", "wrong")},
            {"authorization": _basic(ADMIN, "")},  # the token as the user name is not it
            {"authorization": "Bearer wrong"},
            {"authorization": "Basic %%%"},
        ):
            resp = httpx.get(page, headers=refused)
            assert resp.status_code == 401, refused
            # The challenge is what makes a browser prompt for the token.
            assert resp.headers["www-authenticate"] == ADMIN_CHALLENGE == 'Basic realm="pdgate"'
            assert resp.json()["error"]["code"] == "invalid_api_key"

        for user in ("ops", ""):  # any user name, the token as password
            ok = httpx.get(page, auth=(user, ADMIN))
            assert ok.status_code == 200
            assert ok.headers["content-type"] == "text/html; charset=utf-8"
            assert "<title>pdgate" in ok.text
        assert httpx.get(page, headers={"authorization": f"Bearer {ADMIN}"}).status_code == 200

        csp = ok.headers["content-security-policy"]
        directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
        assert directives["default-src"] == "'none'"
        for name in ("script-src", "style-src", "connect-src"):
            assert directives[name] == "'self'", name
        assert "unsafe" not in csp and "*" not in csp
        assert ok.headers["x-content-type-options"] == "nosniff"
        assert ok.headers["cache-control"] == "no-store"

        for path, media_type in (("app.js", "text/javascript"), ("app.css", "text/css")):
            url = f"{c.url}/dashboard/{path}"
            assert httpx.get(url).status_code == 401
            asset = httpx.get(url, auth=("ops", ADMIN))
            assert asset.status_code == 200
            assert asset.headers["content-type"].startswith(media_type)
            assert asset.headers["x-content-type-options"] == "nosniff"
            assert asset.content == (STATIC / f"dashboard.{path.split('.')[1]}").read_bytes()

        # What the page polls takes the same Basic credentials (a browser resends them).
        for path in ("/admin/instances", "/admin/queues", "/admin/series", "/admin/ratio"):
            assert httpx.get(c.url + path, auth=("ops", ADMIN)).status_code == 200, path
            refused_json = httpx.get(c.url + path)
            assert refused_json.status_code == 401, path
            assert refused_json.headers["www-authenticate"] == ADMIN_CHALLENGE


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.inline_scripts = 0
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        self.urls += [v for k, v in found.items() if k in ("src", "href") and v is not None]
        assert "style" not in found, f"inline style on <{tag}> (the CSP refuses it)"
        assert not any(k.startswith("on") for k in found), f"inline handler on <{tag}>"
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline_scripts += 1


def test_the_page_loads_nothing_from_elsewhere() -> None:
    """Offline by construction: the page names only its own two files, relatively (so a path
    prefix in front of the gateway keeps working), and the script fetches relative paths."""
    links = _Links()
    links.feed((STATIC / "dashboard.html").read_text())
    assert sorted(links.urls) == ["dashboard/app.css", "dashboard/app.js"]
    assert links.inline_scripts == 0
    script = (STATIC / "dashboard.js").read_text()
    # The one absolute URL is SVG's namespace name, an identifier that is never fetched.
    assert re.findall(r"\w+://[^\s\"'`]+", script) == ["http://www.w3.org/2000/svg"]
    assert "innerHTML" not in script and "eval(" not in script
    css = (STATIC / "dashboard.css").read_text()
    assert "url(" not in css and "@import" not in css and "@font-face" not in css


def test_every_file_of_the_page_is_package_data() -> None:
    """An installed gateway reads the page from its package: a file the package-data globs
    miss would be absent from the wheel and fail the gateway's start."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["pdgate.gateway.api"]
    names = sorted(f"static/{p.name}" for p in STATIC.iterdir())
    assert {"static/dashboard.css", "static/dashboard.html", "static/dashboard.js"} <= set(names)
    assert all(any(fnmatch(n, g) for g in globs) for n in names), (names, globs)


# -- the page in a browser -------------------------------------------------------------------


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    chromium = require_binary("chromium", "the dashboard is tested in a real browser")
    chromedriver = require_binary("chromedriver", "selenium drives chromium through it")
    options = Options()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        f"--window-size={WIDTH},{HEIGHT}",
        "--disable-dev-shm-usage",  # containers give /dev/shm 64 MiB
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--hide-scrollbars",
    ):
        options.add_argument(arg)
    if os.geteuid() == 0:
        # Chromium refuses to start its sandbox as root (CI containers often are).
        options.add_argument("--no-sandbox")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Both paths given: selenium uses them as they are and never downloads a driver.
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    try:
        driver.set_page_load_timeout(20)
        driver.set_script_timeout(10)
        # The viewport exactly, whatever the window decorations: the screenshot's size.
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
        )
        yield driver
    finally:
        driver.quit()


# Read what the page shows (its text), in one round trip.
_READ_PAGE = """
const text = (id) => document.querySelector(`#${id} .value`).textContent;
const rows = {};
for (const tr of document.querySelectorAll("tr[data-instance]")) {
  const cells = {};
  for (const td of tr.querySelectorAll("td[data-field]")) cells[td.dataset.field] = td.textContent;
  rows[tr.dataset.instance] = cells;
}
return {
  status: document.getElementById("status").className,
  statusText: document.getElementById("status").textContent,
  rows,
  streams: text("sum-streams"),
  inflight: text("sum-inflight"),
  success: text("sum-success"),
  rate: text("sum-rate"),
  ttftPoints: Number(document.getElementById("chart-ttft").dataset.points || 0),
  requestPoints: Number(document.getElementById("chart-requests").dataset.points || 0),
  ratioGroups: [...document.querySelectorAll("#ratio tr[data-group]")].map((r) => r.dataset.group),
  queues: document.querySelectorAll("#queues tr[data-queue]").length,
};
"""


def _page(driver: WebDriver) -> dict[str, Any]:
    data: dict[str, Any] = driver.execute_script(_READ_PAGE)
    return data


def _number(text: str) -> int:
    return int(text) if text.isdigit() else -1


class _Load:
    """Streaming clients with long outputs, each in its own thread, until stopped."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self._url = url + "/v1/completions"
        self._max_tokens = max_tokens
        self._stop = threading.Event()
        self.done = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), name=f"load-{i}", daemon=True)
            for i in range(clients)
        ]

    def _client(self, i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"client {i}: " + "tell me about disaggregated serving " * 40,
            "max_tokens": self._max_tokens,
            "stream": True,
        }
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    with client.stream("POST", self._url, json=body) as resp:
                        last = ""
                        for line in resp.iter_lines():
                            last = line or last
                        ok = resp.status_code == 200 and last == "data: [DONE]"
                        why = f"HTTP {resp.status_code}, last line {last[:200]!r}"
                except httpx.HTTPError as exc:
                    ok, why = False, repr(exc)
                with self._lock:
                    if ok:
                        self.done += 1
                    elif len(self.errors) < 20:
                        self.errors.append(why)

    def __enter__(self) -> _Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)  # a stream in progress runs to its end first
        assert not any(t.is_alive() for t in self._threads), "a load client did not stop"


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


# Ten seconds as a test; PDGATE_UPDATE_DOCS=1 adds up to two minutes of history for the picture.
@pytest.mark.timeout(300)
def test_the_page_in_a_browser_shows_the_fleet_and_follows_load(
    browser: WebDriver, tmp_path: Path
) -> None:
    update_docs = os.environ.get("PDGATE_UPDATE_DOCS") == "1"
    # Small batches so that 10 clients fill the decodes' slots and the page shows pressure.
    with ThreadedCluster(
        prefills=2, decodes=2, gateway={"admin_token": ADMIN}, shim={"capacity": 4}
    ) as c:
        expected = {row["id"] for row in c.instances()}
        assert len(expected) == 4
        # Credentials in the URL take the path a person at the prompt does: Chromium sends
        # them only when the 401 challenges for Basic, then its auth cache supplies them to
        # the page's files and its fetches (which must not carry them in their URLs).
        scheme, host = c.url.split("://", 1)
        browser.get(f"{scheme}://ops:{ADMIN}@{host}/dashboard")

        def idle_view() -> bool:
            page = _page(browser)
            return "live" in page["status"] and set(page["rows"]) == expected

        wait_for(idle_view, 15, "the page to list every instance")
        idle = _page(browser)
        assert idle["streams"] == "0" and idle["inflight"] == "0", idle
        assert all(r["streams"] == "0" and r["accepted"] == "0" for r in idle["rows"].values())
        assert idle["ratioGroups"] == ["default"]
        assert idle["requestPoints"] > 0 and idle["ttftPoints"] == 0  # zeros, no TTFT yet

        seen_busy: dict[str, Any] = {}
        with _Load(c.url, clients=10, max_tokens=400) as load:

            def busy() -> bool:
                page = _page(browser)
                rows = page["rows"].values()
                ok = (
                    _number(page["streams"]) > 0
                    and _number(page["inflight"]) > 0
                    and any(_number(r["streams"]) > 0 for r in rows)
                    and any(not r["slots"].startswith("0/") for r in rows)
                    and sum(_number(r["accepted"]) for r in rows) > 0
                    and page["ttftPoints"] > 0
                    and page["success"] == "100%"
                    and "live" in page["status"]
                )
                if ok:
                    seen_busy.update(page)
                return ok

            wait_for(busy, 30, "the page to show the load")
            if update_docs:
                # Let the charts gather a minute of history for the picture in the README.
                wait_for(lambda: load.done >= 150 and busy(), 120, "a fuller history")
            shot = tmp_path / "dashboard.png"
            assert browser.save_screenshot(str(shot))
        assert not load.errors, load.errors
        assert load.done > 0

        # The counts fall back once the load is gone: the page follows, it does not stick.
        def settled() -> bool:
            page = _page(browser)
            return page["streams"] == "0" and page["inflight"] == "0"

        wait_for(settled, 15, "the page to show the fleet idle again")
        after = _page(browser)
        accepted = sum(_number(r["accepted"]) for r in after["rows"].values())
        assert accepted >= load.done  # every finished request was accepted by a prefill

        # Nothing came from another origin, and the console is clean (CSP violations, script
        # errors and failed fetches all log at SEVERE).
        origins: list[str] = browser.execute_script(
            "return performance.getEntriesByType('resource').map((e) => new URL(e.name).origin)"
        )
        assert len(origins) >= 5 and set(origins) == {c.url.rstrip("/")}, origins
        severe = [
            e["message"]
            for e in browser.get_log("browser")
            if e["level"] == "SEVERE" and "favicon.ico" not in e["message"]
        ]
        assert not severe, severe

    assert _png_size(shot) == (WIDTH, HEIGHT)
    if update_docs:
        DOCS_SCREENSHOT.write_bytes(shot.read_bytes())
