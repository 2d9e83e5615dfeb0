"""The README's first agent ("Writing an agent") run as written: its code and its commands are
read from README.md and run on the distributed setup (Postgres, RabbitMQ, a real Celery worker
whose PYTHONPATH holds the agent's package, the model gateway over HTTP)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command

from store.models import Project, Rollout, Span
from trainer import conventions as c
from trainer.llm.server import ServerThread, build_gateway

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def readme_example() -> tuple[str, list[str]]:
    """The agent's module and the shell lines of README "Writing an agent"."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Writing an agent"):text.index("### The sweep")]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    code = next(body for lang, body in blocks
                if lang == "python" and body.startswith("# myagents/math.py"))
    shell = next(body for lang, body in blocks if lang == "bash" and "--llm" in body)
    return code, shell.splitlines()


def line_with(lines: list[str], word: str) -> str:
    return next(line for line in lines if word in line)


@pytest.mark.django_db(transaction=True)
def test_the_readme_agent_runs_as_written_with_its_llm_resource(
        model_dir, rabbitmq_url, sending_to, celery_workers, tmp_path, monkeypatch, settings):
    """Issue 26 finding 5: the example could not be given its `llm` resource, did not pass
    `llm["api_key"]` (401), and workers could not import it."""
    code, lines = readme_example()
    (tmp_path / "myagents").mkdir()
    (tmp_path / "myagents" / "math.py").write_text(code)
    subprocess.run(["bash", "-c", line_with(lines, "> tasks.jsonl")], cwd=tmp_path, check=True)
    serve = shlex.split(line_with(lines, "llm_serve").split("&")[0])
    model = serve[serve.index("--model") + 1].partition("=")[0]
    server = ServerThread(build_gateway(models=[f"{model}={model_dir}"]).app()).start()
    try:
        settings.LLM_GATEWAY_URL = f"http://127.0.0.1:{server.port}/v1"
        pythonpath, lightning, *args = shlex.split(line_with(lines, "rollouts_enqueue"))
        assert (pythonpath, lightning) == ("PYTHONPATH=$PWD", "./lightning")
        # As the README says: the worker's PYTHONPATH holds the agent's package (and the
        # enqueueing process's: here, this one's sys.path).
        celery_workers(queues=["rollouts"], broker_url=rabbitmq_url, concurrency=2,
                       env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
        monkeypatch.chdir(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path))
        out = StringIO()
        call_command(*args, "--wait-timeout", "240", stdout=out, stderr=StringIO())
    finally:
        server.stop()
    assert out.getvalue().splitlines()[-1] == '{"succeeded": 2}'
    project = Project.objects.get(name="myproject")
    for rollout in Rollout.objects.filter(project=project):
        names = sorted(Span.objects.filter(rollout=rollout).values_list("name", flat=True))
        assert names.count(c.LLM_CALL_SPAN) == 1, names  # the call, recorded as its span
        assert "solve" in names and "agentlightning.annotation" in names
        resources = project.resource_sets.get(
            resources_id=rollout.resources_id).versions.get().resources
        assert resources == {"llm": {"resource_type": "proxy_llm", "model": model,
                                     "endpoint": settings.LLM_GATEWAY_URL}}
