"""Pure parts of the trainer: the span adapter, group advantages, checkpoint files."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from core import control
from store import hooks
from trainer import checkpoints, reactions, services
from trainer import conventions as c
from trainer.algorithms import FinishedRollout, TripletAdapter, algorithm_load
from trainer.algorithms.grpo import group_advantages


def decision(agent: str, turn: int, action: int, seq: int) -> dict:
    return {"name": c.DECISION_SPAN, "sequence_id": seq, "attributes": {
        c.ATTR_AGENT: agent, c.ATTR_TURN: turn, c.ATTR_OBSERVATION: [float(turn), 1.0],
        c.ATTR_ACTION: action, c.ATTR_LOGPROB: -0.5}}


def reward(value: float, seq: int) -> dict:
    return {"name": c.REWARD_ANNOTATION_SPAN, "sequence_id": seq,
            "attributes": {"agentlightning.reward.0.name": "primary",
                           "agentlightning.reward.0.value": value}}


def rollout(rid: str, group: str, value: float) -> FinishedRollout:
    spans = [decision("planner", 0, 1, 1), decision("coder", 1, 2, 2),
             decision("coder", 2, 3, 3), reward(0.0, 4), reward(value, 5),
             {"name": "llm.call", "sequence_id": 6, "attributes": {}}]
    return FinishedRollout(rollout_id=rid, mode="train", status="succeeded",
                           input={"group": group}, spans=spans)


def test_each_decision_becomes_a_triplet_with_the_final_reward():
    samples = TripletAdapter().samples(rollout("r1", "g", 0.75))
    assert [s.actions for s in samples] == [[1], [2], [3]]
    assert {s.reward for s in samples} == {0.75}
    assert samples[0].observations == [[0.0, 1.0]] and samples[0].logprobs == [-0.5]


def test_only_the_chosen_agents_decisions_are_trained():
    samples = TripletAdapter(agents=frozenset({"coder"})).samples(rollout("r1", "g", 1.0))
    assert [s.agent for s in samples] == ["coder", "coder"]


def test_trajectory_aggregation_makes_one_sample_per_episode():
    (sample,) = TripletAdapter(aggregation="trajectory").samples(rollout("r1", "g", 1.0))
    assert sample.actions == [1, 2, 3] and sample.logprobs == [-0.5, -0.5, -0.5]


def test_a_rollout_without_reward_gives_no_samples():
    bare = FinishedRollout("r", "train", "succeeded", {}, [decision("a", 0, 1, 1)])
    assert TripletAdapter().samples(bare) == []


def test_advantages_are_relative_to_the_group_and_flat_groups_are_dropped():
    samples = [s for rid, group, value in [("a", "g1", 1.0), ("b", "g1", 0.0),
                                           ("c", "g2", 0.5), ("d", "g2", 0.5)]
               for s in TripletAdapter(aggregation="trajectory").samples(
                   rollout(rid, group, value))]
    adv = group_advantages(samples)
    assert set(adv) == {"a", "b"}
    assert adv["a"] == pytest.approx(1.0, abs=1e-4) and adv["b"] == pytest.approx(-1.0, abs=1e-4)


def test_unknown_algorithms_are_refused():
    with pytest.raises(ImportError):
        algorithm_load("no.such.Algorithm", {})
    with pytest.raises(ValueError):
        algorithm_load("trainer.checkpoints.CheckpointError", {})


def test_checkpoints_round_trip_and_a_corrupt_file_is_refused(settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path)}}}
    resource = checkpoints.checkpoint_save(payload={"w": torch.ones(3)}, name_prefix="t",
                                           step=1)
    again = checkpoints.checkpoint_save(payload={"w": torch.ones(3)}, name_prefix="t", step=1)
    assert again["name"] == resource["name"] and len(list(tmp_path.rglob("*.pt"))) == 1
    checkpoints._cache.clear()
    assert torch.equal(checkpoints.checkpoint_load(resource)["w"], torch.ones(3))
    (tmp_path / resource["name"]).write_bytes(b"tampered")
    checkpoints._cache.clear()
    with pytest.raises(checkpoints.CheckpointError, match="sha256"):
        checkpoints.checkpoint_load(resource)


def test_the_trainer_plugs_into_the_store_hook_and_the_control_sweep():
    assert control._reconcilers["training_steps"] is services.steps_redispatch
    assert control._reconcilers["training_groups"] is reactions.groups_completed
    assert reactions.groups_completed in hooks._completed_callbacks["trainer"]


def test_a_process_that_never_trains_never_loads_torch():
    """The API server and other processes load torch only when they train or run an agent
    that needs it: torch costs seconds of start-up and ~150 MB per process."""
    code = (
        "import sys, django; django.setup();"
        "from django.urls import resolve; resolve('/v1/agl/health');"
        "import lightning_site.wsgi, core.celery, trainer.services, trainer.algorithms;"
        "from trainer.algorithms import algorithm_load;"
        "assert 'torch' not in sys.modules, 'torch was imported';"
        "from trainer.algorithms import GRPO; assert 'torch' in sys.modules; print('ok')"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "lightning_site.settings"}
    env.pop("DATABASE_URL", None)  # the embedded default needs no server
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
