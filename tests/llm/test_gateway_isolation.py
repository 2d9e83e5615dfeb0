"""One model namespace per tenant (issue 24, point 7): through the official openai client,
two projects training the same example never serve each other's weights, a key cannot make
the gateway load a checkpoint its project did not train, and nothing lists another tenant's
models."""

from __future__ import annotations

import httpx
import openai
import pytest

from store import services
from trainer import conventions as c
from trainer.checkpoints import checkpoint_save_dir
from trainer.llm.registry import Registry, Space
from trainer.models import TrainingJob

from .test_gateway import MESSAGES, client, llm_spans, started_attempt

pytestmark = pytest.mark.slow


@pytest.fixture
def storage(settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "checkpoints": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path / "ckpt")}}}


def job_checkpoint(project, model_dir, step=0):
    job = TrainingJob.objects.create(project=project, agent="examples.llm_cipher.agent",
                                     algorithm="grpo_lm")
    return checkpoint_save_dir(directory=model_dir, name_prefix=f"jobs/{job.pk}", step=step)


def llm(base, version, checkpoint, model="llm-cipher"):
    return {"llm": {"resource_type": "proxy_llm", "endpoint": f"{base}/v1", "model": model,
                    "version": version, "checkpoint": checkpoint}}


def publish(project, resources):
    return services.resources_add(project=project, resources=resources).resource_set.resources_id


def test_two_tenants_same_model_name_and_versions_never_share_weights(
        gateway_server, keyed, model_dir, storage):
    gateway, base = gateway_server
    a, a_key, b, b_key = keyed
    a_ckpt, b_ckpt = job_checkpoint(a, model_dir), job_checkpoint(b, model_dir)
    a_res, b_res = publish(a, llm(base, 0, a_ckpt)), publish(b, llm(base, 0, b_ckpt))
    a_rid, a_aid = started_attempt(a, a_res)
    b_rid, b_aid = started_attempt(b, b_res)
    client(base, a_key, a_rid, a_aid).chat.completions.create(
        model="llm-cipher", messages=MESSAGES, max_tokens=2)
    client(base, b_key, b_rid, b_aid).chat.completions.create(
        model="llm-cipher", messages=MESSAGES, max_tokens=2)
    a_space, b_space = Space(a.pk, a_res, "llm-cipher"), Space(b.pk, b_res, "llm-cipher")
    assert gateway.registry.loaded_versions(a_space) == [0]
    assert gateway.registry.loaded_versions(b_space) == [0]
    assert gateway.registry.by_name("llm-cipher", project_id=a.pk) is not \
        gateway.registry.by_name("llm-cipher", project_id=b.pk)

    # A publishes a far-ahead version into its own resources (what poisoned B before): B's
    # calls are still B's v0, and B's spans say so.
    services.resources_update(project=a, resources_id=a_res, resources=llm(base, 1001, a_ckpt))
    gateway.poll_once()
    assert gateway.registry.loaded_versions(a_space) == [0, 1001]
    client(base, b_key, b_rid, b_aid).chat.completions.create(
        model="llm-cipher", messages=MESSAGES, max_tokens=2)
    assert gateway.registry.loaded_versions(b_space) == [0]
    assert [s.attributes[c.LLM_VERSION] for s in llm_spans(b_rid)] == [0, 0]


@pytest.mark.parametrize("name", ["other-project", "../../..", "jobs/x/step-0-ab", "models/z"])
def test_a_key_cannot_make_the_gateway_load_what_its_project_did_not_train(
        gateway_server, keyed, model_dir, storage, name):
    gateway, base = gateway_server
    a, a_key, b, _ = keyed
    checkpoint = dict(job_checkpoint(b, model_dir))  # B's real checkpoint
    if name != "other-project":
        checkpoint["name"] = name
    resources_id = publish(a, llm(base, 0, checkpoint))
    rid, aid = started_attempt(a, resources_id)
    loads = gateway.registry.loads
    with pytest.raises(openai.PermissionDeniedError) as caught:
        client(base, a_key, rid, aid).chat.completions.create(
            model="llm-cipher", messages=MESSAGES, max_tokens=2)
    assert caught.value.status_code == 403
    assert caught.value.body["code"] == "checkpoint_not_allowed"
    assert gateway.registry.loads == loads and gateway.registry.spaces(a.pk) == []
    assert llm_spans(rid) == []


def test_unattributed_calls_and_listings_see_only_the_callers_models(
        gateway_server, keyed, model_dir, storage):
    gateway, base = gateway_server
    a, a_key, b, b_key = keyed
    a_res = publish(a, llm(base, 0, job_checkpoint(a, model_dir)))
    rid, aid = started_attempt(a, a_res)
    client(base, a_key, rid, aid).chat.completions.create(
        model="llm-cipher", messages=MESSAGES, max_tokens=2)

    # A may call its job's model unattributed; B may not, and does not see it listed.
    assert client(base, a_key).chat.completions.create(
        model="llm-cipher", messages=MESSAGES, max_tokens=2).choices
    with pytest.raises(openai.NotFoundError):
        client(base, b_key).chat.completions.create(
            model="llm-cipher", messages=MESSAGES, max_tokens=2)
    assert sorted(m.id for m in client(base, a_key).models.list()) == ["llm-cipher", "tiny"]
    assert [m.id for m in client(base, b_key).models.list()] == ["tiny"]
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}


def test_a_project_keeps_at_most_max_spaces_models_loaded(keyed, model_dir, storage):
    a, _, b, _ = keyed
    registry = Registry(max_spaces=2)
    checkpoint = job_checkpoint(a, model_dir)
    for project, resources_id in [(a, "r1"), (b, "r1"), (a, "r2")]:
        registry.for_resource({"model": "m", "version": 0, "checkpoint": checkpoint},
                              project_id=project.pk, resources_id=resources_id)
    registry.by_name("m", project_id=a.pk)  # r2, the most recently used, stays
    registry.for_resource({"model": "m", "version": 0, "checkpoint": checkpoint},
                          project_id=a.pk, resources_id="r3")
    assert sorted(s.resources_id for s in registry.spaces(a.pk)) == ["r2", "r3"]
    assert [s.resources_id for s in registry.spaces(b.pk)] == ["r1"]  # another project's stay
