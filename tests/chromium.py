"""Headless Chromium for browser tests, driven over the Chrome DevTools protocol.

The browser is Debian's `chromium` package (or $DRAPLANE_CHROMIUM). Where it is missing,
`find_chromium` runs `make chromium`, which installs it with apt when run as root (the CI machine);
elsewhere the caller skips, or fails under CI. The test starts the browser on a DevTools port of
its own (`--remote-debugging-port=0`, the port read back from DevToolsActivePort) and speaks the
protocol over aiohttp's websocket client: no Playwright, no browser download.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import aiohttp

from draplane.localenv.processes import ServerProcess

REPO = Path(__file__).resolve().parents[1]
NAMES = ("chromium", "chromium-browser", "google-chrome")


class BrowserMissing(RuntimeError):
    pass


def _which() -> str | None:
    configured = os.environ.get("DRAPLANE_CHROMIUM")
    if configured:
        return configured if Path(configured).exists() else None
    return next((path for name in NAMES if (path := shutil.which(name))), None)


def find_chromium() -> str:
    """The browser's path; installs Debian's package through `make chromium` when missing."""
    found = _which()
    if found:
        return found
    result = subprocess.run(["make", "--no-print-directory", "-C", str(REPO), "chromium"],
                            capture_output=True, text=True, timeout=900)
    found = _which()
    if found:
        return found
    raise BrowserMissing(f"no chromium, and `make chromium` could not install it (exit {result.returncode}): "
                         f"{(result.stderr or result.stdout).strip()[-2000:]}")


class Chromium:
    """One headless browser with one page."""

    def __init__(self, process: ServerProcess, session: aiohttp.ClientSession, socket, profile: Path):
        self.process = process
        self.session = session
        self.socket = socket
        self.profile = profile
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader = asyncio.create_task(self._read())
        self.console: list[str] = []  # the page's console messages and uncaught exceptions

    @classmethod
    async def start(cls, workdir: Path, *, width: int = 1440, height: int = 900) -> "Chromium":
        binary = find_chromium()
        profile = workdir / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        (profile / "DevToolsActivePort").unlink(missing_ok=True)  # a previous browser's port
        # --no-sandbox: the sandbox cannot start as root, as on the CI machine; the page is our own.
        process = ServerProcess("chromium", [
            binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars", "--mute-audio",
            f"--user-data-dir={profile}", "--remote-debugging-port=0", "--remote-allow-origins=*",
            f"--window-size={width},{height}", "about:blank"], workdir / "chromium.log")
        process.start()
        session = None
        try:
            port = await _devtools_port(profile / "DevToolsActivePort", process, timeout=60.0)
            session = aiohttp.ClientSession()
            targets = await _page_targets(session, port)
            socket = await session.ws_connect(targets[0]["webSocketDebuggerUrl"], max_msg_size=0)
        except BaseException:
            if session is not None:
                await session.close()
            await asyncio.to_thread(process.stop)
            raise
        browser = cls(process, session, socket, profile)
        await browser.send("Runtime.enable")
        await browser.send("Page.enable")
        await browser.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                           mobile=False)
        return browser

    async def _read(self) -> None:
        async for message in self.socket:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(message.data)
            future = self._waiting.pop(data.get("id"), None) if "id" in data else None
            if future is not None and not future.done():
                future.set_result(data)
            elif data.get("method") == "Runtime.consoleAPICalled":
                args = data["params"].get("args", [])
                self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in args))
            elif data.get("method") == "Runtime.exceptionThrown":
                self.console.append("exception: " + json.dumps(data["params"]["exceptionDetails"])[:2000])
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(ConnectionError("the DevTools connection closed"))

    async def send(self, method: str, timeout: float = 30.0, **params) -> dict:
        message_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[message_id] = future
        await self.socket.send_str(json.dumps({"id": message_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(future, timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def navigate(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def evaluate(self, expression: str):
        """The expression's value in the page (JSON-serialisable), or RuntimeError with the exception."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 30.0, what: str | None = None, interval: float = 0.05):
        """Poll until `expression` is truthy in the page; its value."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(interval)
        raise AssertionError(f"timed out after {timeout} s waiting for {what or expression}; last value {value!r}; "
                             f"console: {self.console[-5:]}")

    async def screenshot(self, path: Path) -> Path:
        result = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=False)
        path.write_bytes(base64.b64decode(result["data"]))
        return path

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.send("Browser.close", timeout=5.0), 5.0)
        except (Exception, asyncio.CancelledError):  # noqa: BLE001 - killed below anyway
            pass
        self._reader.cancel()
        await self.socket.close()
        await self.session.close()
        await asyncio.to_thread(self.process.stop)


async def _devtools_port(path: Path, process: ServerProcess, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise RuntimeError(f"chromium exited before it opened its DevTools port:\n{process.log_tail()}")
        try:
            first = path.read_text().splitlines()[0]
            return int(first)
        except (OSError, IndexError, ValueError):
            await asyncio.sleep(0.1)
    raise TimeoutError(f"chromium did not write {path} within {timeout} s:\n{process.log_tail()}")


async def _page_targets(session: aiohttp.ClientSession, port: int) -> list[dict]:
    deadline = time.monotonic() + 30.0
    while True:
        try:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
                pages = [t for t in await response.json() if t.get("type") == "page"]
            if pages:
                return pages
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("chromium opened no page")
        await asyncio.sleep(0.1)
