"""The real agentlightning==0.3.0, unmodified, against our server over HTTP.

AGL lives in its own virtual environment (.venv-agl/, made by tests/agl/setup_venv.sh on first
use: about 800 MB, kept out of the project's dependencies). Its client authenticates with the
key written in the URL (`http://algo:KEY@host:port`, sent as HTTP Basic). Each AGL process
costs seconds of imports, so each scenario is one process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from tests.api.conftest import ROOT, Keys, Server

pytestmark = pytest.mark.slow
AGL_PYTHON = ROOT / ".venv-agl" / "bin" / "python"


@pytest.fixture(scope="session")
def agl_python() -> Path:
    setup = subprocess.run(["bash", str(ROOT / "tests" / "agl" / "setup_venv.sh")],
                           capture_output=True, text=True, timeout=1800)
    if setup.returncode != 0:
        pytest.fail(f"could not install agentlightning==0.3.0:\n{setup.stderr[-3000:]}")
    return AGL_PYTHON


# LiteLLM would download its price list at import; AgentOps would call its cloud.
AGL_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "AGENTOPS_API_ENDPOINT": "http://127.0.0.1:9",
    "AGENTOPS_EXPORTER_ENDPOINT": "http://127.0.0.1:9",
    "AGENTOPS_APP_URL": "http://127.0.0.1:9",
}


def agl_env() -> dict[str, str]:
    return {**os.environ, **AGL_ENV}


def run_agl(python: Path, script: str, *args: str, timeout: int = 300) -> str:
    """Run an AGL script in its own process group, so that the runner processes an AGL
    Trainer spawns are killed with it if it overruns."""
    proc = subprocess.Popen([str(python), str(ROOT / "tests" / "agl" / script), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=agl_env(), cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"{script} did not finish in {timeout} s:\n{err[-6000:]}")
    finally:
        try:  # whatever of the group is left (the script itself has exited by now)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"{script} failed:\n{err[-6000:]}"
    return out


def url_with_key(server: Server, key: str) -> str:
    return server.url.replace("http://", f"http://algo:{key}@")


def test_agl_client_drives_every_store_method(api_server, keys: Keys, agl_python):
    out = run_agl(agl_python, "client_compat.py", url_with_key(api_server, keys.algorithm))
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["rollouts"] == 4 and seen["spans"] == 2 and seen["workers"] == 4


def test_agl_trainer_with_four_runners_succeeds_and_its_spans_arrive_over_otlp(
    api_server, keys: Keys, agl_python, algo
):
    run_agl(agl_python, "trainer_compat.py", url_with_key(api_server, keys.algorithm), "8",
            timeout=600)
    rollouts = algo.get("/rollouts").json()["items"]
    assert len(rollouts) == 8 and {r["status"] for r in rollouts} == {"succeeded"}
    assert all(r["attempt"]["worker_id"] for r in rollouts)  # claimed by AGL runners
    for rollout in rollouts:
        spans = algo.get("/spans", params={"rollout_id": rollout["rollout_id"]}).json()["items"]
        by_name = {span["name"]: span for span in spans}
        work = by_name["compat.work"]
        assert work["attributes"]["compat.value"] == rollout["input"]["value"]
        # The OTLP exporter put the ids on the resource: these came through /v1/traces.
        assert work["resource"]["attributes"]["agentlightning.rollout_id"] == rollout["rollout_id"]
        reward = by_name["agentlightning.annotation"]["attributes"]
        assert reward["agentlightning.reward.0.value"] == pytest.approx(
            rollout["input"]["value"] / 100)
    admin = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    browser = Client()
    browser.force_login(admin)
    page = browser.get("/admin/store/rollout/")
    assert page.status_code == 200 and rollouts[0]["rollout_id"] in page.content.decode()



def test_agl_client_sees_agls_store_semantics(api_server, keys: Keys, agl_python):
    out = run_agl(agl_python, "store_semantics.py", url_with_key(api_server, keys.algorithm))
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["sequence_ids"] == [1, 2, 3, 4, 101]
    # The four cases of AGL 0.3's own store suite (issue 23, point 4), as AGL's store answers.
    suite = seen["agl_suite"]
    assert suite["update_nonexistent_rollout"].startswith(
        "Item does not exist with primary key(s): rollout_id='nonexistent'")
    assert suite["update_nonexistent_attempt"].startswith("No attempts found for rollout ro-")
    assert suite["zero_limit_total"] == 2
