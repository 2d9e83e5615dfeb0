"""The deployment files run as written: compose validates, its commands name real entry points,
and the README's "Distributed" commands are compose's, line by line."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from core.queues import Queue

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
REQUIRED_ENV = {"DJANGO_SECRET_KEY": "k", "FLOWER_BASIC_AUTH": "ops:pw"}


def _compose_cli() -> list[str] | None:
    """`docker compose` (the plugin) where it exists, else the standalone `docker-compose`."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone else None


def _compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (.ci/run installs it)")
    clean = {k: v for k, v in os.environ.items() if k not in REQUIRED_ENV}
    return subprocess.run([*cli, "-f", str(COMPOSE), *args], capture_output=True, text=True,
                          env={**clean, **env}, cwd=ROOT, timeout=120)


@pytest.fixture(scope="module")
def config() -> dict:
    result = _compose("config", env=REQUIRED_ENV)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def _command(service: dict) -> list[str]:
    command = service["command"]
    words = shlex.split(command) if isinstance(command, str) else list(command)
    if words[:2] == ["sh", "-c"]:  # web: migrate && gunicorn ...
        return shlex.split(words[2].split("&&")[-1])
    return words


def test_compose_config_validates_and_refuses_to_start_without_the_secrets():
    for missing in REQUIRED_ENV:
        env = {k: v for k, v in REQUIRED_ENV.items() if k != missing}
        result = _compose("config", env=env)
        assert result.returncode != 0 and missing in result.stderr


def test_the_gpu_worker_is_only_in_the_gpu_profile(config):
    # docker-compose 1.x lists profiled services in `config`; the plugin leaves them out.
    gpu = config["services"].get("worker-training-gpu", {"profiles": ["gpu"]})
    assert gpu["profiles"] == ["gpu"]
    assert not [n for n, s in config["services"].items() if s.get("profiles") and s is not gpu]
    assert "worker-training" in config["services"]
    services = _compose("--profile", "gpu", "config", "--services", env=REQUIRED_ENV)
    assert "worker-training-gpu" in services.stdout.split()


def test_web_runs_the_asgi_front_under_uvicorn(config):
    web = config["services"]["web"]
    words = _command(web)
    assert words[:3] == ["python", "-m", "lightning_site.web"]
    launcher = importlib.import_module("lightning_site.web")
    assert callable(launcher.main)
    assert int(words[words.index("--threads") + 1]) > 1
    assert int(words[words.index("--workers") + 1]) >= 1
    assert "migrate --noinput" in web["command"]
    assert "web" in web["environment"]["DJANGO_ALLOWED_HOSTS"].split(",")
    assert web["environment"]["PROMETHEUS_MULTIPROC_DIR"]  # /metrics sums the processes


def test_every_service_waits_for_healthy_dependencies(config):
    services = config["services"]
    for name in ("postgres", "rabbitmq", "web"):
        assert services[name]["healthcheck"]["test"], name
    for name, service in services.items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert condition["condition"] == "service_healthy", (name, dependency)
            assert "healthcheck" in services[dependency], dependency
    assert "web" in services["worker-rollouts"]["depends_on"]


def test_workers_serve_real_queues_log_at_info_and_share_the_checkpoints(config):
    queues = {q.value for q in Queue}
    served = set()
    for name, service in config["services"].items():
        words = _command(service) if "command" in service else []
        if words[:4] == ["celery", "-A", "lightning_site", "worker"]:
            served.update(words[words.index("-Q") + 1].split(","))
            assert words[words.index("-l") + 1] == "INFO", name
            mounts = [v["target"] if isinstance(v, dict) else v.split(":")[1]
                      for v in service["volumes"]]
            assert service["environment"]["CHECKPOINT_DIR"] in mounts, name
    assert served == queues


def test_flower_reads_the_broker_api_and_requires_basic_auth(config):
    flower = config["services"]["flower"]
    words = _command(flower)
    assert any(w.startswith("--broker_api=http://") for w in words)
    assert flower["environment"]["FLOWER_BASIC_AUTH"] == "ops:pw"
    assert flower["ports"][0]["host_ip"] == "127.0.0.1" if isinstance(flower["ports"][0], dict) \
        else flower["ports"][0].startswith("127.0.0.1:")


def _readme_distributed_commands() -> list[list[str]]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Distributed", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0].startswith(".venv/bin/"):
            commands.append([words[0].removeprefix(".venv/bin/"), *words[1:]])
    return commands


def _comparable(words: list[str]) -> list[str]:
    """Placeholders stand for secrets: the broker API URL, and Flower's basic auth (an
    environment variable in compose, a flag in the README)."""
    words = [re.sub(r"^--broker_api=.*", "--broker_api=URL", w) for w in words]
    return [w for w in words if not w.startswith("--basic-auth=")]


def test_readme_distributed_commands_are_the_compose_commands_line_by_line(config):
    readme = [_comparable(words) for words in _readme_distributed_commands()]
    ours = [s for s in config["services"].values()
            if "command" in s and s.get("image", "").startswith("lightning-orchestrator")]
    compose = [_comparable(_command(s)) for s in ours]  # not Postgres' own settings
    assert sorted(map(tuple, readme)) == sorted({tuple(c) for c in compose})


def test_the_image_runs_the_web_command_and_copies_what_exists():
    dockerfile = (ROOT / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (\S+) ", dockerfile, flags=re.M):
        assert (ROOT / source).exists(), source
    cmd = re.search(r"^CMD (\[.*\])$", dockerfile, flags=re.M).group(1)
    web = yaml.safe_load(COMPOSE.read_text())["services"]["web"]
    assert yaml.safe_load(cmd) == _command(web)


@pytest.mark.parametrize("value,ok", [
    (None, False), ("", False), ("   ", False), (":", False), ("ops:", False), (":longpassword", False),
    ("ops", False), ("ops:short", False), ("ops:longpassword,", False), ("ops:longpassword", True),
    ("ops:longpassword,viewer:another-long-one", True),
])
def test_flower_does_not_start_without_real_credentials(value, ok):
    """An empty FLOWER_BASIC_AUTH made Flower accept `Authorization: Basic ====` (issue 11,
    finding 3). Compose runs lightning_site.flower_auth before Flower; it exits 1 unless every
    entry is user:password."""
    raw = yaml.safe_load(COMPOSE.read_text())["services"]["flower"]["command"]
    words = shlex.split(raw)
    assert words[:2] == ["sh", "-c"]
    steps = [shlex.split(step) for step in words[2].split("&&")]
    assert steps[0] == ["python", "-m", "lightning_site.flower_auth"]
    assert steps[-1][:4] == ["celery", "-A", "lightning_site", "flower"]
    env = {k: v for k, v in os.environ.items() if k != "FLOWER_BASIC_AUTH"}
    if value is not None:
        env["FLOWER_BASIC_AUTH"] = value
    result = subprocess.run([sys.executable, "-m", "lightning_site.flower_auth"], env=env,
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (result.returncode == 0) == ok, result.stderr
    if not ok:
        assert "FLOWER_BASIC_AUTH" in result.stderr


def test_postgres_takes_the_connection_budget_the_readme_sums(config):
    """README "Deploy": the processes' pools pass Postgres' default of 100 connections."""
    words = _command(config["services"]["postgres"])
    setting = next(w for w in words if w.startswith("max_connections="))
    assert int(setting.split("=", 1)[1]) >= 200
    assert "max_connections=${POSTGRES_MAX_CONNECTIONS:-300}" in COMPOSE.read_text()
