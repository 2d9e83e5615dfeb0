"""`./lightning serve`: one command from nothing to a store an AGL client can use (here on a
fresh embedded SQLite file; DATABASE_URL works the same way)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from tests.api.conftest import ROOT
from tests.celery_fixtures import wait_until

PORT = 18421


def _serve(data_dir, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE",
                          "AGL_SERVER_PORT", "PROMETHEUS_MULTIPROC_DIR")}
    return subprocess.Popen(
        [sys.executable, "manage.py", "serve", *args], cwd=ROOT, text=True,
        env={**clean, "LIGHTNING_DATA_DIR": str(data_dir), **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _until_up(url: str, proc: subprocess.Popen) -> None:
    def up() -> bool:
        assert proc.poll() is None, proc.stderr.read()
        try:
            return httpx.get(url + "/v1/agl/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=120, message="the store did not come up")


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    return out, err


@pytest.mark.slow
def test_serve_makes_a_project_and_key_once_and_serves_the_agl_api(tmp_path):
    url = f"http://127.0.0.1:{PORT}"
    first = _serve(tmp_path, env={"AGL_SERVER_PORT": str(PORT)})
    try:
        _until_up(url, first)
    finally:
        out, err = _stop(first)
    client_url = re.search(r'LightningStoreClient\("(http://algorithm:(agl_[\w-]+)@[^"]+)"\)', out)
    assert client_url and client_url.group(1).endswith(f"@127.0.0.1:{PORT}"), out
    key = client_url.group(2)
    assert "Store API at" in out and err.strip() == "", err

    second = _serve(tmp_path, "--port", str(PORT))
    try:
        _until_up(url, second)
        enqueued = httpx.post(url + "/v1/agl/queues/rollouts/enqueue", auth=("algorithm", key),
                              json={"rollouts": [{"input": {"task": 1}}]}, timeout=10)
        refused = httpx.post(url + "/v1/agl/queues/rollouts/enqueue", auth=("algorithm", "x"),
                             json={"rollouts": [{"input": {}}]}, timeout=10)
    finally:
        out, err = _stop(second)
    assert enqueued.is_success and enqueued.json()[0]["status"] == "queuing"
    assert refused.status_code == 401
    assert "agl_" not in out and "Project 'default' exists" in out
    assert "Traceback" not in err, err  # the 401 above is logged, nothing else


def test_a_bad_agl_server_port_is_named(tmp_path):
    proc = _serve(tmp_path, env={"AGL_SERVER_PORT": "47x"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "AGL_SERVER_PORT='47x' is not a port number" in err
