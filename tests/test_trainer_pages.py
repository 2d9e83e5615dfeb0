"""Job pages: rendered by Django's test client, and loaded in a real headless Chromium (through
chromedriver's W3C WebDriver protocol) with a screenshot saved under test-artifacts/."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
from pytest_django.live_server_helper import LiveServer

from examples.cipher import job_spec
from store import services as store_services
from tests.celery_fixtures import wait_until
from tests.trainer_helpers import capture_sends, drive
from trainer import services
from trainer.models import TrainingJob

pytestmark = pytest.mark.django_db(transaction=True)
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
SERVER_ADDR, DRIVER_PORT = "127.0.0.1:18251", 18252
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run",
               "--window-size=1400,1800"]


@pytest.fixture
def trained_job(monkeypatch, settings, tmp_path) -> TrainingJob:
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path / "checkpoints")}}}
    sent = capture_sends(monkeypatch)
    spec = job_spec(seed=0, steps=3)
    spec["config"].update({"tasks_per_step": 4, "group_size": 4, "val_every": 1})
    job = services.job_create(
        project=store_services.project_create(name="pages"), agent=spec["agent"],
        algorithm="grpo", config=spec["config"], train_dataset=spec["train_dataset"],
        val_dataset=spec["val_dataset"][:4], name="cipher",
    )
    return drive(services.job_start(job_id=job.pk), sent)


def test_job_pages_show_plots_steps_checkpoints_and_admin_links(staff, trained_job):
    listing = staff.get("/jobs/")
    assert listing.status_code == 200 and f"/jobs/{trained_job.pk}/" in listing.text
    page = staff.get(f"/jobs/{trained_job.pk}/")
    assert page.status_code == 200
    html = page.text
    assert html.count('<svg class="chart"') == 3
    assert "Reward per step" in html and "validation" in html
    first = trained_job.steps.get(n=0)
    assert f"/admin/store/rollout/?group__id__exact={first.group_id}" in html
    assert "Checkpoint history" in html and "(best)" in html
    assert "no live worker serves queue &#x27;training&#x27;" in html  # the worker registry
    # The fair share (README "Scheduling"): the project's weight and this job's party.
    assert "Fair share" in html and "max concurrent rollouts none" in html
    assert f"trainer/job/{trained_job.pk} (this job)" in html
    assert "<script" not in html and "http://" not in html.replace("http://www.w3.org", "")
    admin = staff.get(f"/admin/store/rollout/?group__id__exact={first.group_id}")
    assert admin.status_code == 200
    assert f"{first.rollout_count + first.val_rollout_count} rollouts" in admin.text
    groups = staff.get("/admin/store/rolloutgroup/")
    assert groups.status_code == 200 and f"trainer/step/{first.pk}/r0" in groups.text
    assert staff.get("/admin/trainer/trainingjob/").status_code == 200
    assert staff.get("/admin/trainer/trainingstep/").status_code == 200


def test_job_pages_need_a_staff_login(client, trained_job):
    assert client.get(f"/jobs/{trained_job.pk}/").status_code == 302


def _webdriver(method: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{DRIVER_PORT}{path}", method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def chromedriver(tmp_path):
    if not shutil.which("chromedriver") or not shutil.which("chromium"):
        pytest.skip("chromium and chromium-driver are not installed (.ci/run installs them)")
    process = subprocess.Popen(
        ["chromedriver", f"--port={DRIVER_PORT}", "--allowed-ips=127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        wait_until(lambda: _port_open(DRIVER_PORT), timeout=30, message="no chromedriver")
        yield
    finally:
        process.kill()
        process.wait(timeout=30)


@pytest.fixture
def live_site():
    server = LiveServer(SERVER_ADDR)
    try:
        yield f"http://{SERVER_ADDR}"
    finally:
        server.stop()


def test_the_job_page_loads_in_headless_chromium(staff, trained_job, chromedriver,
                                                 live_site, tmp_path):
    caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
        "binary": shutil.which("chromium"),
        "args": [*CHROME_ARGS, f"--user-data-dir={tmp_path / 'chrome-profile'}"]}}}}
    session = _webdriver("POST", "/session", caps)["value"]["sessionId"]
    base = f"/session/{session}"
    try:
        _webdriver("POST", f"{base}/url", {"url": f"{live_site}/jobs/"})  # cookie domain
        _webdriver("POST", f"{base}/cookie", {"cookie": {
            "name": "sessionid", "value": staff.cookies["sessionid"].value, "path": "/"}})
        _webdriver("POST", f"{base}/url", {"url": f"{live_site}/jobs/{trained_job.pk}/"})
        title = _webdriver("GET", f"{base}/title")["value"]
        charts = _webdriver("POST", f"{base}/execute/sync", {
            "script": "return document.querySelectorAll('svg.chart polyline').length", "args": []
        })["value"]
        shot = base64.b64decode(_webdriver("GET", f"{base}/screenshot")["value"])
    finally:
        _webdriver("DELETE", base)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "trainer-job-page.png").write_bytes(shot)
    assert title.startswith(f"Job {trained_job.pk}")
    assert charts >= 3  # train and validation reward, loss, throughput lines drawn
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 10_000
