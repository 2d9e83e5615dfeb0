"""`from trainer import fit`: the Python entry point, on the embedded default as a notebook
user runs it (a fresh process, SQLite, in-process workers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from examples.cipher.agent import cipher_agent
from tests.test_trainer_commands import embedded_env
from trainer import fit
from trainer.fitting import agent_path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """
import json
from examples.cipher import job_spec
from trainer import fit

spec = job_spec(steps=1)
config = {**spec["config"], "steps": 1, "tasks_per_step": 2, "group_size": 2, "val_every": 1}
job = fit(agent=spec["agent"], algorithm=spec["algorithm"], config=config, n_runners=2,
          train_dataset=spec["train_dataset"][:8], val_dataset=spec["val_dataset"][:4])
steps = [step.metrics for step in job.steps.order_by("n")]
print(json.dumps({"status": job.status, "steps": steps, "best": job.best_version}))
"""


@pytest.mark.slow
def test_fit_runs_a_job_on_the_embedded_default_and_returns_it_with_its_metrics(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=embedded_env(tmp_path), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == "succeeded"
    assert len(result["steps"]) == 2 and "train_reward" in result["steps"][0]
    assert "val_reward" in result["steps"][0]
    assert (tmp_path / "lightning.sqlite3").exists()


def test_fit_runs_nothing_in_a_runner_process(monkeypatch):
    monkeypatch.setenv("AGL_CURRENT_ROLE", "runner")
    with pytest.raises(RuntimeError, match="manage.py runner"):
        fit(agent="examples.cipher.agent.cipher_agent", train_dataset=[1])


def test_agents_are_named_by_their_dotted_path():
    assert agent_path("pkg.mod:agent") == "pkg.mod:agent"
    assert agent_path(cipher_agent) == "examples.cipher.agent:cipher_agent"

    def local(task):
        return 0.0

    with pytest.raises(ValueError, match="importable"):
        agent_path(local)
