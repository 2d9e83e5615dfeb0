"""`rollouts_enqueue`'s inputs and resources: checked before anything is created, each mistake
one line naming the file (and line) or the option."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from store.models import Project, Rollout

AGENT = ["--agent", "tests.celery_agents:ok_agent"]


def enqueue_error(*args: str) -> str:
    with pytest.raises(CommandError) as raised:
        call_command("rollouts_enqueue", "p", "--create-project", *AGENT, *args,
                     stdout=StringIO())
    assert "\n" not in str(raised.value)
    return str(raised.value)


@pytest.mark.django_db
def test_a_bad_inputs_file_is_one_line_naming_the_file_and_line(tmp_path, monkeypatch):
    """Issue 26 finding 7: a missing or malformed --inputs-file was a traceback."""
    monkeypatch.chdir(tmp_path)
    Path("tasks.jsonl").write_text('{"i": 1}\n\n{"i": 2\n')
    Path("empty.jsonl").write_text("\n")

    def error(name: str) -> str:
        return enqueue_error("--inputs-file", name)

    assert error("tasks.jsonl").startswith(
        "--inputs-file tasks.jsonl:3: not JSON (Expecting ',' delimiter, column 8)")
    assert error("nope.jsonl") == "--inputs-file nope.jsonl: No such file or directory"
    assert error("empty.jsonl") == "--inputs-file empty.jsonl: no inputs (one JSON input per line)"
    assert not Project.objects.filter(name="p").exists()


@pytest.mark.django_db
def test_resources_given_on_the_command_line_are_pinned_by_every_rollout(
        tmp_path, monkeypatch, settings, django_capture_on_commit_callbacks):
    """Issue 26 finding 5: `rollouts_enqueue` had no way to give an agent its `llm`."""
    monkeypatch.chdir(tmp_path)
    settings.LLM_GATEWAY_URL = "http://gateway:4748/v1"
    Path("prompt.json").write_text(json.dumps({"resource_type": "prompt_template",
                                               "template": "Q: {q}", "engine": "f-string"}))
    with django_capture_on_commit_callbacks():  # the messages are not sent
        call_command("rollouts_enqueue", "p", "--create-project", *AGENT, "--count", "2",
                     "--resource", 'limits={"max_turns": 3}', "--resource", "prompt=@prompt.json",
                     "--llm", "mymodel", stdout=StringIO())
    rollouts = list(Rollout.objects.filter(project__name="p"))
    assert len(rollouts) == 2 and len({r.resources_id for r in rollouts}) == 1
    version = Project.objects.get(name="p").resource_sets.get().versions.get()
    assert version.resources == {
        "limits": {"max_turns": 3},
        "prompt": {"resource_type": "prompt_template", "template": "Q: {q}",
                   "engine": "f-string"},
        "llm": {"resource_type": "proxy_llm", "endpoint": "http://gateway:4748/v1",
                "model": "mymodel"},
    }


@pytest.mark.django_db
def test_a_bad_resource_is_one_line_and_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("bad.json").write_text('{"resource_type":\n nope}')
    assert enqueue_error("--resource", "llm") == (
        "--resource 'llm': expected NAME=JSON or NAME=@FILE")
    assert enqueue_error("--resource", "llm={x}").startswith(
        "--resource llm: not JSON (Expecting property name enclosed in double quotes, line 1")
    assert enqueue_error("--resource", "llm=[1]") == (
        "--resource llm: a resource must be a JSON object, got list")
    assert enqueue_error("--resource", "llm=@bad.json").startswith(
        "--resource llm: bad.json: not JSON (Expecting value, line 2 column 2)")
    assert enqueue_error("--resource", "llm=@none.json") == (
        "--resource llm: none.json: No such file or directory")
    assert not Project.objects.filter(name="p").exists()


@pytest.mark.django_db
def test_an_agent_that_does_not_import_says_where_workers_look():
    with pytest.raises(CommandError) as raised:
        call_command("rollouts_enqueue", "p", "--create-project", "--agent",
                     "myagents_not_here.math:agent", stdout=StringIO())
    assert str(raised.value) == (
        "agent: agent module 'myagents_not_here.math' cannot be imported: No module named "
        "'myagents_not_here' (is the directory holding it on PYTHONPATH here? README 'Writing "
        "an agent')")
