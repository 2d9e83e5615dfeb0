"""Partial rollouts (job config partial_rollouts, asynchronous jobs): an LLM rollout in flight
when a new version is published continues on it for its next calls. Real gateway over HTTP,
real hot reload; each call's span records the version that served it, the token adapter
carries per-token versions into the samples, and the bound is checked on the oldest token."""

from __future__ import annotations

import dataclasses

import pytest

from store import services
from store.models import Rollout
from store.services import RolloutSpec
from tests.llm.test_gateway import MESSAGES, client, llm_spans
from trainer import conventions as c
from trainer import selectors, staleness
from trainer.algorithms.token_adapter import TokenAdapter
from trainer.checkpoints import checkpoint_save_dir
from trainer.llm.registry import Space
from trainer.models import TrainingJob

pytestmark = pytest.mark.slow


def test_a_partial_rollouts_calls_carry_two_versions_and_the_bound_takes_the_oldest(
        gateway_server, keyed, model_dir, settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path / "ckpt")}}}
    gateway, base = gateway_server
    project, key, *_ = keyed
    job = TrainingJob.objects.create(project=project, agent="a", algorithm="grpo_lm")
    checkpoint = checkpoint_save_dir(directory=model_dir, name_prefix=f"jobs/{job.pk}", step=0)

    def llm(version):
        return {"llm": {"resource_type": "proxy_llm", "endpoint": f"{base}/v1", "model": "job-x",
                        "version": version, "checkpoint": checkpoint}}

    resources_id = services.resources_add(project=project, resources=llm(0)) \
        .resource_set.resources_id
    # one rollout marked as the trainer marks a partial rollout, one pinned as usual
    services.rollout_enqueue_many(project=project, specs=[
        RolloutSpec(input={"group": "g"}, resources_id=resources_id,
                    metadata={c.LLM_LATEST: True}),
        RolloutSpec(input={"group": "g"}, resources_id=resources_id)])
    claimed = [services.rollout_dequeue(project=project, worker_id="w") for _ in range(2)]
    (partial, partial_attempt), (pinned, pinned_attempt) = (
        (r, a) for r, a in sorted(claimed, key=lambda ra: c.LLM_LATEST not in ra[0].metadata))

    def call(rollout, attempt):
        client(base, key, rollout.pk, attempt.attempt_id).chat.completions.create(
            model="job-x", messages=MESSAGES, max_tokens=3, temperature=1.0, seed=1)

    call(partial, partial_attempt)
    call(pinned, pinned_attempt)
    # the trainer publishes checkpoint 1 while both episodes are in flight
    services.resources_update(project=project, resources_id=resources_id, resources=llm(1))
    gateway.poll_once()
    assert 1 in gateway.registry.loaded_versions(Space(project.pk, resources_id, "job-x"))
    call(partial, partial_attempt)
    call(pinned, pinned_attempt)
    # each call's span says which version served it: the partial rollout moved on
    assert [s.attributes[c.LLM_VERSION] for s in llm_spans(partial.pk)] == [0, 1]
    assert [s.attributes[c.LLM_VERSION] for s in llm_spans(pinned.pk)] == [0, 0]
    for rollout, attempt in ((partial, partial_attempt), (pinned, pinned_attempt)):
        services.attempt_finish(project=project, rollout_id=rollout.pk,
                                attempt_id=attempt.attempt_id, status="succeeded")
    finished = {r.rollout_id: r for r in selectors._finished(
        Rollout.objects.filter(pk__in=[partial.pk, pinned.pk]))}
    # the token adapter carries each generated token's version into the samples
    reward = {"name": c.REWARD_LEGACY_SPAN, "attributes": {"reward": 1.0}, "sequence_id": 99}
    done = finished[partial.pk]
    samples = TokenAdapter().samples(dataclasses.replace(done, spans=[*done.spans, reward]))
    assert [s.version for s in samples] == [0, 1]
    for sample in samples:
        generated = {v for v, m in zip(sample.versions, sample.mask, strict=True) if m}
        assert generated == {sample.version}
        assert all(v is None for v, m in zip(sample.versions, sample.mask, strict=True)
                   if not m)
    # the bound is checked on the oldest token: checkpoint 0 = resources version 1, so a
    # step training from version 3 with max_staleness=1 may not use it, though its last
    # call was served by checkpoint 1
    assert done.version == 1
    assert staleness.too_stale([done.version], base=3, limit=1) == 1
    assert staleness.too_stale([done.version], base=2, limit=1) == 0
    assert finished[pinned.pk].version == 1
