"""The built-in live page, GET /dashboard, in headless Chromium against a gateway under load.

The simulated pair serves a gateway whose crossover is lowered (8, hysteresis 3) so that 30
held streams put it in `plain` mode with requests in flight on both backends. The browser
opens the page, short streaming requests come and go (mtp mode) for a few polls, then the load
ramps up (30 long streams opened one by one while the short ones go on), so every chart has a
history; then the load is held steady: no request starts or ends. After the page has polled
twice more, its rendered DOM is read and every tile is compared with `/admin/state` (fixed
admin key) read at that same steady moment; the state is read before and after to prove it did
not move. The charts must be drawn, the page must log no error, and a 1400x900 screenshot of
that same moment is saved (tmp_path; also to $MTP_GATEWAY_DASHBOARD_PNG when set).

Chromium is driven over the DevTools protocol on `--remote-debugging-pipe` (a small client
below; no extra dependency), not with `--dump-dom --virtual-time-budget`: that one does run the
page's fetches (5 polls in 0.7 s of wall time), but virtual time cannot be held in step with
the test's real-time load, and the DOM and the screenshot would be two different page loads.
Here the page is read at a moment the test chooses (after the ramp, while the load is steady,
after N real polls), and the DOM and the screenshot come from the same page at that moment.

The committed docs/dashboard.png is made by this test:
    MTP_GATEWAY_DASHBOARD_PNG=docs/dashboard.png python -m pytest tests/test_dashboard.py
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import json
import os
import shutil
import signal
import struct
import time
from collections.abc import AsyncIterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.sim.server import SimOptions, start_sim_pair
from tests.conftest import live_gateway
from tests.live import wait_until
from tests.test_gateway_live import OpenStream, chat

CHROMIUM = next((p for p in (os.environ.get("CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser"), "/usr/bin/chromium")
                 if p and os.access(p, os.X_OK)), None)
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-extensions", "--disable-default-apps", "--mute-audio", "--hide-scrollbars",
]
WIDTH, HEIGHT = 1400, 900
ADMIN_KEY = "dashboard-test-admin-key"
ROUTING = {"crossover": 8, "hysteresis": 3, "min_dwell_s": 0}
HELD = 30
CALL_TIMEOUT_S = 10.0

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="the dashboard's browser test needs Chromium: `apt-get install chromium` (Debian/Ubuntu; "
           ".ci/run does this), or CHROMIUM=/path/to/chromium-or-chrome")


# --- a tiny DevTools-protocol client over --remote-debugging-pipe ----------------------------

class DevTools:
    """Chromium reads NUL-terminated JSON commands on its fd 3 and answers on its fd 4."""

    def __init__(self, pid: int, write_fd: int, reader: asyncio.StreamReader,
                 stderr_path: Path) -> None:
        self.pid = pid
        self.write_fd = write_fd
        self.reader = reader
        self.stderr_path = stderr_path
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        self.next_id = 0
        self.listener = asyncio.create_task(self._listen())

    async def _listen(self) -> None:
        try:
            while True:
                message = json.loads((await self.reader.readuntil(b"\0"))[:-1])
                future = self.pending.pop(message.get("id", -1), None)
                if future is None:
                    self.events.append(message)
                elif not future.done():
                    future.set_result(message)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            for future in self.pending.values():
                if not future.done():
                    future.set_exception(RuntimeError(f"chromium closed the pipe: {exc}; "
                                                      f"stderr: {self.stderr_tail()}"))

    def stderr_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.stderr_path.read_text(errors="replace")[-2000:]
        return ""

    async def call(self, method: str, params: dict[str, Any] | None = None,
                   session: str | None = None) -> dict[str, Any]:
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        future = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = future
        os.write(self.write_fd, json.dumps(message).encode() + b"\0")
        answer = await asyncio.wait_for(future, CALL_TIMEOUT_S)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return answer["result"]

    async def evaluate(self, expression: str, session: str) -> Any:
        result = await self.call("Runtime.evaluate", {"expression": expression,
                                                      "returnByValue": True}, session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")


def _high_fd(fd: int) -> int:
    """The same pipe end on a close-on-exec fd >= 10, so that it cannot be 3 or 4 itself."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


@contextlib.asynccontextmanager
async def chromium(user_data_dir: Path) -> AsyncIterator[DevTools]:
    assert CHROMIUM is not None
    to_chrome_r, to_chrome_w = map(_high_fd, os.pipe())
    from_chrome_r, from_chrome_w = map(_high_fd, os.pipe())
    args = [*CHROMIUM_FLAGS, f"--user-data-dir={user_data_dir}",
            f"--window-size={WIDTH},{HEIGHT}", "--remote-debugging-pipe", "about:blank"]
    stderr_path = user_data_dir.parent / "chromium.stderr"
    stderr_fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    null_fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:  # posix_spawn: the pipe ends land on the child's fds 3 and 4, no shell, no preexec
        pid = os.posix_spawn(CHROMIUM, [CHROMIUM, *args], os.environ, setsid=True, file_actions=[
            (os.POSIX_SPAWN_DUP2, null_fd, 0), (os.POSIX_SPAWN_DUP2, null_fd, 1),
            (os.POSIX_SPAWN_DUP2, stderr_fd, 2), (os.POSIX_SPAWN_DUP2, to_chrome_r, 3),
            (os.POSIX_SPAWN_DUP2, from_chrome_w, 4)])
    finally:
        for fd in (to_chrome_r, from_chrome_w, stderr_fd, null_fd):
            os.close(fd)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=64 << 20)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                os.fdopen(from_chrome_r, "rb", buffering=0))
    devtools = DevTools(pid, to_chrome_w, reader, stderr_path)
    try:
        await devtools.call("Browser.getVersion")
        yield devtools
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(devtools.call("Browser.close"), 3)
        if not await _exited(pid, 5):
            os.killpg(pid, signal.SIGKILL)  # the group of the browser this test started
            await _exited(pid, 5)
        devtools.listener.cancel()
        transport.close()
        os.close(to_chrome_w)


async def _exited(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            return True
        await asyncio.sleep(0.05)
    return False


async def open_page(devtools: DevTools, url: str) -> str:
    target = await devtools.call("Target.createTarget", {"url": "about:blank"})
    attached = await devtools.call("Target.attachToTarget",
                                   {"targetId": target["targetId"], "flatten": True})
    session = attached["sessionId"]
    await devtools.call("Runtime.enable", {}, session)  # exceptions and console messages
    await devtools.call("Log.enable", {}, session)  # failed loads, CSP and other browser errors
    await devtools.call("Emulation.setDeviceMetricsOverride",
                        {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1,
                         "mobile": False}, session)
    await devtools.call("Page.navigate", {"url": url}, session)
    return session


async def polls(devtools: DevTools, session: str) -> int:
    return int(await devtools.evaluate("Number(document.body?.dataset.polls || 0)", session))


async def wait_for_polls(devtools: DevTools, session: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (seen := await polls(devtools, session)) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"the page polled {seen} times, not {count}, in {timeout} s")
        await asyncio.sleep(0.05)


# --- reading the rendered DOM ------------------------------------------------------------------

class Rendered(HTMLParser):
    """Text of every element with an id, and the SVG shapes drawn inside each chart."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
            "track", "wbr"}

    def __init__(self, html: str) -> None:
        super().__init__()
        self.text: dict[str, str] = {}
        self.shapes: dict[str, list[tuple[str, dict[str, str | None]]]] = {}
        self.body: dict[str, str | None] = {}
        self._open: list[str | None] = []  # the id of each open element (None: no id)
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "body":
            self.body = attributes
        chart = next((i for i in reversed(self._open) if i and i.startswith("chart-")), None)
        if chart is not None:
            self.shapes.setdefault(chart, []).append((tag, attributes))
        if tag in self.VOID:
            return
        element_id = attributes.get("id")
        if element_id:
            self.text.setdefault(element_id, "")
        self._open.append(element_id)

    def handle_endtag(self, tag: str) -> None:
        if tag not in self.VOID and self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for element_id in self._open:
            if element_id and not element_id.startswith("chart-"):
                self.text[element_id] += data

    def tile(self, element_id: str) -> str:
        return " ".join(self.text[element_id].split())

    def drawn(self, chart: str, tag: str, color: str) -> int:
        return sum(1 for t, a in self.shapes.get(chart, [])
                   if t == tag and color in (a.get("stroke"), a.get("fill")))


def is_page_error(event: dict[str, Any]) -> bool:
    method, params = event.get("method"), event.get("params", {})
    return (method == "Runtime.exceptionThrown"
            or (method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"))
            or (method == "Log.entryAdded" and params["entry"].get("level") == "error"))


def js_round(x: float) -> int:
    return int(x + 0.5)  # Math.round for x >= 0 (Python's round() is banker's rounding)


def expected_tiles(state: dict[str, Any]) -> dict[str, str]:
    """What each tile must show for this /admin/state: its numbers, as they are."""
    mtp, plain = state["backends"]["mtp"], state["backends"]["plain"]
    served = mtp["served"] + plain["served"]

    def share(n: int) -> str:
        return f"{js_round(100 * n / served)}%" if served else "–"

    usable = [n for n in ("mtp", "plain")
              if state["backends"][n]["up"] and not state["backends"][n]["circuit_open"]]
    cap = mtp["effective_cap"]
    return {
        "mode": state["mode"],
        "concurrency": str(state["concurrency"]),
        "crossover": str(state["crossover"]),
        "hysteresis": str(state["routing"]["hysteresis"]),
        "policy": state["routing"]["policy"],
        "inflight-mtp": str(mtp["inflight"]),
        "cap-mtp": "?" if cap is None else str(cap),
        "inflight-plain": str(plain["inflight"]),
        "share-mtp": share(mtp["served"]),
        "share-plain": share(plain["served"]),
        "served-mtp": str(mtp["served"]),
        "served-plain": str(plain["served"]),
        "up": " + ".join(usable) if usable else "none",
    }


def steady_part(state: dict[str, Any]) -> dict[str, Any]:
    """The state without what moves by itself (clock, monitor's accept length and loads)."""
    return {"mode": state["mode"], "concurrency": state["concurrency"],
            "routing": state["routing"], "ttft": state["ttft"],
            "backends": {n: {k: b[k] for k in ("inflight", "served", "up", "circuit_open",
                                               "effective_cap")}
                         for n, b in state["backends"].items()}}


async def admin_state(client: httpx.AsyncClient, url: str,
                      headers: dict[str, str]) -> dict[str, Any]:
    assert (await client.get(url + "/admin/state")).status_code == 401  # the key is needed
    response = await client.get(url + "/admin/state", headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


# --- the test ------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
async def test_dashboard_shows_admin_state_under_load(tmp_path: Path) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with start_sim_pair(SimOptions(speed=20)) as sim, \
            live_gateway(sim, routing=ROUTING, auth={"admin_key": ADMIN_KEY}) as gateway, \
            httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=100)) as client, \
            chromium(tmp_path / "profile") as devtools:
        url = gateway.url + "/v1/chat/completions"
        session = await open_page(devtools, gateway.url + "/dashboard")
        await wait_for_polls(devtools, session, 1, timeout=10)

        # Below the crossover: short streaming requests come and go (mtp mode). Then the ramp:
        # HELD long streams are opened one by one while the short ones go on.
        stop = asyncio.Event()

        async def churn() -> None:
            while not stop.is_set():
                response = await client.post(url, json=chat(max_tokens=6, stream=True))
                assert response.status_code == 200

        churners = [asyncio.create_task(churn()) for _ in range(2)]
        held: list[OpenStream] = []
        try:
            await wait_for_polls(devtools, session, 3, timeout=10)
            for _ in range(HELD):
                held.append(await OpenStream(client, url, chat(max_tokens=100000, stream=True,
                                                               ignore_eos=True)).open())
                await asyncio.sleep(0.1)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*churners), 10)
            await wait_until(lambda: gateway.pool.concurrency == HELD, timeout=5)

            # Steady: nothing starts or ends. Let the page poll twice more, then read it.
            before = await admin_state(client, gateway.url, admin)
            seen = await polls(devtools, session)
            await wait_for_polls(devtools, session, seen + 2, timeout=10)  # a poll a second
            html = await devtools.evaluate("document.documentElement.outerHTML", session)
            shot = await devtools.call("Page.captureScreenshot", {"format": "png"}, session)
            after = await admin_state(client, gateway.url, admin)
            page_errors = [e["params"] for e in devtools.events if is_page_error(e)]
        finally:
            stop.set()
            for task in churners:
                task.cancel()
            await asyncio.gather(*churners, return_exceptions=True)
            await asyncio.gather(*(s.close() for s in held), return_exceptions=True)

    png = base64.b64decode(shot["data"])
    (tmp_path / "dashboard.png").write_bytes(png)
    assert png_size(png) == (WIDTH, HEIGHT)

    # The load is what was asked for, and it did not move while the page was read.
    assert steady_part(before) == steady_part(after)
    state = after
    assert state["mode"] == "plain" and state["concurrency"] == HELD
    assert state["backends"]["mtp"]["inflight"] > 0 and state["backends"]["plain"]["inflight"] > 0
    assert state["backends"]["mtp"]["served"] > 0 and state["backends"]["plain"]["served"] > 0
    assert "url" in state["backends"]["mtp"]  # the admin view

    # Every tile shows exactly the admin state's numbers.
    page = Rendered(html)
    assert not page_errors, page_errors
    assert int(page.body.get("data-polls") or 0) >= 3
    assert page.tile("status") == ""
    shown = {tile: page.tile(tile) for tile in expected_tiles(state)}
    assert shown == expected_tiles(state)
    assert 0 <= int(page.tile("mode-for")) <= state["mode_for_s"] + 1

    # The charts are drawn: lines for every series, both mode bands, TTFT points per backend.
    for color in ("#0969da", "#cf222e", "#bf8700"):
        assert page.drawn("chart-concurrency", "polyline", color), color
    assert page.drawn("chart-concurrency", "rect", "#f3ecff")  # mtp mode, before the ramp
    assert page.drawn("chart-concurrency", "rect", "#e9f7ec")  # plain mode, after it
    for color in ("#8250df", "#1a7f37", "#cf222e"):
        assert page.drawn("chart-inflight", "polyline", color), color
    for color in ("#8250df", "#1a7f37"):
        assert page.drawn("chart-ttft", "circle", color), color
        assert page.drawn("chart-finished", "polyline", color), color

    if target := os.environ.get("MTP_GATEWAY_DASHBOARD_PNG"):  # docs/dashboard.png, when asked
        Path(target).write_bytes(png)



@pytest.mark.timeout(60)
async def test_dashboard_shows_each_pair(tmp_path: Path) -> None:
    """Two pairs: a tile per pair with its own mode and in-flight counts, as /dashboard/state
    has them, and the role tiles add up both pairs."""
    from prometheus_client import CollectorRegistry

    from gateway.app import create_app
    from gateway.config import build_settings
    from tests.live import serve_app

    async with start_sim_pair(SimOptions(speed=1)) as pair_a, \
            start_sim_pair(SimOptions(speed=1)) as pair_b:
        settings = build_settings({"monitor": {"interval_s": 0.05}, "pairs": [
            {"name": name, "mtp": {"url": sim.urls["mtp"]}, "plain": {"url": sim.urls["plain"]},
             "routing": {"crossover": crossover, "hysteresis": 1, "min_dwell_s": 0,
                         "adaptive_crossover": False}}  # the configured crossover decides
            for name, sim, crossover in (("a", pair_a, 4), ("b", pair_b, 12))]})
        app = create_app(settings, registry=CollectorRegistry())
        async with serve_app(app) as url, \
                httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=20)) as client, \
                chromium(tmp_path / "profile") as devtools:
            session = await open_page(devtools, url + "/dashboard")
            await wait_for_polls(devtools, session, 1, timeout=10)
            held = []
            try:
                for _ in range(9):  # a, b, a, b, ...: a reaches its crossover of 4, b not 12
                    held.append(await OpenStream(client, url + "/v1/chat/completions",
                                                 chat(max_tokens=100000, stream=True,
                                                      ignore_eos=True)).open())
                state = (await client.get(url + "/dashboard/state")).json()
                seen = await polls(devtools, session)
                await wait_for_polls(devtools, session, seen + 2, timeout=10)  # a poll a second
                tiles = await devtools.evaluate(
                    "[...document.querySelectorAll('#pairs .tile')]"
                    ".map((t) => [t.dataset.pair, t.innerText])", session)
                inflight_mtp = await devtools.evaluate(
                    "document.getElementById('inflight-mtp').textContent", session)
                page_errors = [e["params"] for e in devtools.events if is_page_error(e)]
            finally:
                await asyncio.gather(*(s.close() for s in held), return_exceptions=True)

    assert not page_errors, page_errors
    assert {p["name"]: p["mode"] for p in state["pairs"]} == {"a": "plain", "b": "mtp"}
    backends = state["backends"]
    assert [name for name, _ in tiles] == ["a", "b"]
    for (name, text), pair in zip(tiles, state["pairs"], strict=True):
        mtp, plain = (backends[f"{name}/{role}"]["inflight"] for role in ("mtp", "plain"))
        words = text.split()
        assert words[8].isdigit()  # the crossover in force: moves with MTP's accept length
        assert words[:8] + words[9:] == ["pair", name, pair["mode"], str(pair["concurrency"]),
                                         "in", "flight", "·", "crossover", "mtp", str(mtp), "·",
                                         "plain", str(plain)], text
    assert inflight_mtp == str(backends["a/mtp"]["inflight"] + backends["b/mtp"]["inflight"])
