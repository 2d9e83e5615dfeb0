"""The job page while a job runs: it reloads itself, and its cancel and resume buttons call
the trainer's services (also clicked in a real Chromium)."""

from __future__ import annotations

import time

import pytest

from examples.cipher import job_spec
from store import services as store_services
from tests.browser import chromium
from tests.trainer_helpers import capture_sends
from trainer import services
from trainer.models import TrainingJob

pytestmark = pytest.mark.django_db(transaction=True)
SERVER_ADDR, DRIVER_PORT = "127.0.0.1:18441", 18442
REFRESH = '<meta http-equiv="refresh" content="5">'


@pytest.fixture
def running_job(monkeypatch) -> TrainingJob:
    capture_sends(monkeypatch)  # no broker: the messages are recorded, not sent
    spec = job_spec(seed=0, steps=2)
    job = services.job_create(
        project=store_services.project_create(name="controls"), agent=spec["agent"],
        algorithm="grpo", config=spec["config"], train_dataset=spec["train_dataset"],
        val_dataset=spec["val_dataset"][:4], name="cipher")
    return services.job_start(job_id=job.pk)


def test_a_running_job_page_reloads_itself_and_offers_cancel(staff, running_job):
    html = staff.get(f"/jobs/{running_job.pk}/").text
    assert REFRESH in html and "Cancel job" in html and "Resume from" not in html


def test_cancel_then_resume_from_the_page(staff, running_job):
    page = f"/jobs/{running_job.pk}/"
    assert staff.get(f"{page}cancel/").status_code == 405  # a GET changes nothing
    answer = staff.post(f"{page}cancel/", follow=True)
    assert answer.redirect_chain[-1][0] == page
    assert f"Job {running_job.pk}: cancelled." in answer.text
    running_job.refresh_from_db()
    assert running_job.status == "cancelled"
    assert REFRESH not in answer.text and "Resume from the last finished step" in answer.text
    answer = staff.post(f"{page}resume/", follow=True)
    running_job.refresh_from_db()
    assert running_job.status == "running" and "from its last finished step" in answer.text


def test_the_buttons_need_a_staff_login(client, running_job):
    assert client.post(f"/jobs/{running_job.pk}/cancel/").status_code == 302  # to the login
    running_job.refresh_from_db()
    assert running_job.status == "running"


def test_the_cancel_button_works_in_chromium(staff, running_job, live_site, tmp_path):
    with chromium(DRIVER_PORT, tmp_path / "profile") as browser:
        browser.login(live_site, staff.cookies["sessionid"].value)
        browser.get(f"{live_site}/jobs/{running_job.pk}/")
        browser.js("document.querySelector('button.cancel').click()")
        for _ in range(100):
            status = browser.js("var s = document.querySelector('h1 .status');"
                                "return s ? s.textContent : null")
            if status == "cancelled":
                break
            time.sleep(0.1)
        browser.screenshot("job-page-cancelled.png")
        resume = browser.js("return !!document.querySelector('button.resume')")
    running_job.refresh_from_db()
    assert status == "cancelled" and running_job.status == "cancelled" and resume
