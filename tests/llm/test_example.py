"""`./lightning train examples.llm_cipher`, shortened, as a user runs it: the embedded default
in a subprocess (SQLite, in-process Celery workers, the model gateway over real HTTP), the
agent calling it with the official openai client, grpo_lm training from the recorded tokens
and the gateway hot-reloading each new checkpoint. The validation reward must rise."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess

import pytest
from django.conf import settings

from tests.api.conftest import free_port
from tests.test_trainer_commands import ROOT, embedded_env, manage

pytestmark = pytest.mark.slow
STEPS = 20


def test_the_llm_example_learns_through_the_gateway(tmp_path, model_dir):
    port = free_port()
    env = {**embedded_env(tmp_path), "LLM_GATEWAY_PORT": str(port),
           "LIGHTNING_MODELS_DIR": str(settings.MODELS_DIR),  # the session's built model
           }
    subprocess.run(manage("migrate", "-v0"), env=env, cwd=ROOT, check=True, timeout=300)
    done = subprocess.run(manage("train", "examples.llm_cipher", "--steps", str(STEPS), "--quiet"),
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.search(r"validation reward ([\d.]+) \(untrained\) -> ([\d.]+) \(final\)",
                      done.stdout)
    assert match, done.stdout
    before = float(match[1])
    assert before <= 0.3
    with sqlite3.connect(tmp_path / "lightning.sqlite3") as db:
        best = db.execute("SELECT MAX(json_extract(metrics, '$.val_reward')) "
                          "FROM trainer_trainingstep").fetchone()[0]
        rows = db.execute("SELECT attributes FROM store_span WHERE name = ?",
                          ("openai.chat.completion",)).fetchall()
        versions = {json.loads(a)["lightning.llm.version"] for (a,) in rows}
        llm = [json.loads(r)["llm"] for (r,) in db.execute(
            "SELECT resources FROM store_resourceversion ORDER BY version")]
    # every rollout's call was recorded, by each checkpoint version in turn (hot reload)
    assert best >= before + 0.4, done.stdout  # the full example goes on to >= 0.8
    assert len(rows) >= STEPS * 16 * 10 + (STEPS + 1) * 20
    assert versions == set(range(STEPS + 1))
    # one llm version per checkpoint (retention keeps the last ones and the best)
    assert [x["version"] for x in llm] == sorted({x["version"] for x in llm})
    assert llm[-1]["version"] == STEPS
    assert all(x["endpoint"] == f"http://127.0.0.1:{port}/v1" for x in llm)
