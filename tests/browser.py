"""A headless Chromium driven through chromedriver's W3C WebDriver protocol (Debian's
chromium and chromium-driver packages; .ci/run installs them), for tests that look at pages."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.celery_fixtures import wait_until

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run",
               "--window-size=1400,1400"]


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class Browser:
    def __init__(self, port: int, session: str | None):
        self.port = port
        self.base = f"/session/{session}" if session else ""

    def call(self, method: str, path: str, body: dict | None = None) -> Any:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{self.base}{path}", method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["value"]

    def get(self, url: str) -> None:
        self.call("POST", "/url", {"url": url})

    def login(self, site: str, sessionid: str) -> None:
        self.get(f"{site}/admin/login/")  # the cookie's domain must be open first
        self.call("POST", "/cookie", {"cookie": {"name": "sessionid", "value": sessionid,
                                                 "path": "/"}})

    def js(self, script: str, *args: Any) -> Any:
        return self.call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def screenshot(self, name: str) -> bytes:
        shot = base64.b64decode(self.call("GET", "/screenshot"))
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / name).write_bytes(shot)
        return shot


@contextmanager
def chromium(port: int, profile: Path) -> Iterator[Browser]:
    if not shutil.which("chromedriver") or not shutil.which("chromium"):
        pytest.skip("chromium and chromium-driver are not installed (.ci/run installs them)")
    driver = subprocess.Popen(
        ["chromedriver", f"--port={port}", "--allowed-ips=127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        wait_until(lambda: _port_open(port), timeout=30, message="no chromedriver")
        caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
            "binary": shutil.which("chromium"),
            "args": [*CHROME_ARGS, f"--user-data-dir={profile}"]}}}}
        session = Browser(port, None).call("POST", "/session", caps)["sessionId"]
        browser = Browser(port, session)
        try:
            yield browser
        finally:
            browser.call("DELETE", "")
    finally:
        driver.kill()
        driver.wait(timeout=30)
