"""/metrics: who may scrape it, what it says about the store, and counters summed across
server processes (prometheus-client's multiprocess mode, emptied at start by lightning_site/web.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest
import yaml
from django.contrib.auth.models import User
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from store import services, watchdog
from tests.api.conftest import ROOT, database_url_for_tests
from tests.celery_fixtures import wait_until
from tests.conftest import backdate, claim, enqueue
from trainer.llm.metrics import record_completion

pytestmark = pytest.mark.django_db(transaction=True)
SERVER_PORT = 18410


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_need_staff_or_the_bearer_token(client, settings):
    settings.METRICS_TOKEN = "scrape-me"
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = client.get("/metrics", headers={"Authorization": "Bearer scrape-me"})
    assert ok.status_code == 200 and ok["Content-Type"].startswith("text/plain")
    settings.METRICS_TOKEN = None
    assert client.get("/metrics", headers={"Authorization": "Bearer None"}).status_code == 401
    client.force_login(User.objects.create_user("ops", is_staff=True))
    assert client.get("/metrics").status_code == 200


def test_the_scrape_reports_rollouts_queue_depth_attempts_resources_and_requests(
        client, settings):
    settings.METRICS_TOKEN = "t"
    auth = {"Authorization": "Bearer t"}
    project = services.project_create(name="metered")
    enqueue(project, 3)
    claim(project)
    services.resources_add(project=project, resources={"prompt": {"text": "hi"}})
    before = REGISTRY.get_sample_value("lightning_http_requests_total", {
        "route": "/v1/agl/health", "method": "GET", "status": "200"}) or 0.0
    assert client.get("/v1/agl/health").status_code == 200
    samples = _samples(client.get("/metrics", headers=auth).text)

    def value(name: str, **labels: str) -> float:
        return samples[(name, frozenset(labels.items()))]

    assert value("lightning_rollouts", project="metered", status="queuing") == 2
    assert value("lightning_rollouts", project="metered", status="preparing") == 1
    assert value("lightning_queue_depth", project="metered") == 2
    assert value("lightning_attempts", status="preparing") == 1
    assert value("lightning_attempts_retried") == 0
    assert [v for (n, labels), v in samples.items() if n == "lightning_resource_versions"
            and ("project", "metered") in labels] == [1]
    assert value("lightning_workers_live", queue="rollouts") == 0
    assert value("lightning_http_requests_total", route="/v1/agl/health", method="GET",
                 status="200") == before + 1
    assert value("lightning_http_request_seconds_bucket", route="/v1/agl/health",
                 le="+Inf") >= 1


def test_the_scrape_counts_the_spans_written(client, settings):
    """lightning_spans_ingested is Postgres' count of rows written to the span table, which
    its statistics publish shortly after commit: the scrape sees two more spans."""
    settings.METRICS_TOKEN = "t"
    auth = {"Authorization": "Bearer t"}

    def ingested() -> float:
        samples = _samples(client.get("/metrics", headers=auth).text)
        return samples.get(("lightning_spans_ingested", frozenset()), 0.0)

    before = ingested()
    project = services.project_create(name="spans-metered")
    enqueue(project, 1)
    rollout, attempt = claim(project)
    services.spans_add(project=project, spans=[{
        "rollout_id": rollout.pk, "attempt_id": attempt.attempt_id, "sequence_id": n,
        "trace_id": "a" * 32, "span_id": f"{n:016x}", "parent_id": None, "name": "s",
        "status": {"status_code": "OK", "description": None}, "attributes": {}, "events": [],
        "links": [], "start_time": 1.0, "end_time": 2.0, "context": None, "parent": None,
        "resource": {"attributes": {}, "schema_url": ""}} for n in (1, 2)])
    wait_until(lambda: ingested() >= before + 2, timeout=30,
               message="lightning_spans_ingested did not count the two spans")


def test_the_scrape_has_rollout_duration_and_queue_wait_histograms_and_jobs(client, settings):
    """The figures the seeds name (issue 26.6), read from the rows by project and mode."""
    settings.METRICS_TOKEN = "t"
    project = services.project_create(name="timed")
    enqueue(project, 3, mode="train")
    rollout, attempt = claim(project)
    services.attempt_finish(project=project, rollout_id=rollout.pk,
                            attempt_id=attempt.attempt_id, status="succeeded")
    samples = _samples(client.get("/metrics", headers={"Authorization": "Bearer t"}).text)

    def value(name: str, **labels: str) -> float:
        return samples[(name, frozenset(labels.items()))]

    labels = {"project": "timed", "mode": "train"}
    assert value("lightning_rollout_duration_seconds_count", **labels) == 1
    assert value("lightning_rollout_duration_seconds_bucket", le="+Inf", **labels) == 1
    assert value("lightning_rollout_duration_seconds_bucket", le="3600.0", **labels) == 1
    assert 0 <= value("lightning_rollout_duration_seconds_sum", **labels) < 3600
    assert value("lightning_rollout_queue_wait_seconds_count", **labels) == 1
    assert value("lightning_rollout_queue_wait_seconds_bucket", le="+Inf", **labels) == 1
    assert ("lightning_jobs", frozenset({("status", "running")})) not in samples


def test_the_scrape_counts_finished_rollouts_ended_attempts_verdicts_and_steps(
        client, settings):
    """Counters read from the rows (issue 26.6): finished rollouts by final status, ended
    attempts, the watchdog's verdicts (one revived by a late report still counts), and every
    finished training step's seconds."""
    from examples.cipher import job_spec
    from trainer import services as trainer_services
    from trainer.models import TrainingStep

    settings.METRICS_TOKEN = "t"
    project = services.project_create(name="counted")
    enqueue(project, 4, mode="train", config={"unresponsive_seconds": 10})
    claimed = [claim(project) for _ in range(4)]
    for (rollout, attempt), status in zip(claimed[:2], ("succeeded", "failed"), strict=True):
        services.attempt_finish(project=project, rollout_id=rollout.pk,
                                attempt_id=attempt.attempt_id, status=status)
    for _, attempt in claimed[2:]:
        backdate(attempt, 11)
    assert len(watchdog.sweep().unresponsive) == 2
    revived, attempt = claimed[3]
    services.attempt_update(project=project, rollout_id=revived.pk,
                            attempt_id=attempt.attempt_id, status="running")
    spec = job_spec(seed=0, steps=1)
    job = trainer_services.job_create(
        project=project, agent=spec["agent"], algorithm="grpo", config=spec["config"],
        train_dataset=spec["train_dataset"], val_dataset=spec["val_dataset"][:2])
    for n, seconds in enumerate((0.4, 7.0)):
        TrainingStep.objects.create(job=job, n=n, status="done", resources_version=1,
                                    timings={"train_seconds": seconds})
    samples = _samples(client.get("/metrics", headers={"Authorization": "Bearer t"}).text)

    def value(name: str, **labels: str) -> float:
        return samples.get((name, frozenset(labels.items())), 0.0)

    finished = {"project": "counted", "mode": "train"}
    assert value("lightning_rollouts_finished_total", status="succeeded", **finished) == 1
    assert value("lightning_rollouts_finished_total", status="failed", **finished) == 3  # the revived one too (a terminal rollout stays)
    assert [value("lightning_attempts_ended_total", status=s)
            for s in ("succeeded", "failed", "unresponsive", "running")] == [1, 1, 1, 0]
    assert value("lightning_watchdog_verdicts_total", verdict="unresponsive") == 2
    job_label = {"job": str(job.pk)}
    assert value("lightning_train_step_seconds_count", **job_label) == 2
    assert value("lightning_train_step_seconds_bucket", le="0.5", **job_label) == 1
    assert value("lightning_train_step_seconds_sum", **job_label) == pytest.approx(7.4)


def test_gateway_completions_count_tokens_and_latency():
    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"model": "tiny"}) or 0.0

    before = [sample(n) for n in ("lightning_gateway_requests_total",
                                  "lightning_gateway_prompt_tokens_total",
                                  "lightning_gateway_completion_tokens_total",
                                  "lightning_gateway_request_seconds_count")]
    record_completion("tiny", prompt_tokens=12, completion_tokens=30, seconds=0.4)
    record_completion(model="tiny", prompt_tokens=3, completion_tokens=5, seconds=1.2)
    after = [sample(n) for n in ("lightning_gateway_requests_total",
                                 "lightning_gateway_prompt_tokens_total",
                                 "lightning_gateway_completion_tokens_total",
                                 "lightning_gateway_request_seconds_count")]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 15, 35, 2]


@pytest.fixture
def server_multiprocess(tmp_path):
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    (metrics_dir / "counter_stale.db").write_bytes(b"left by a previous run")
    env = {**os.environ, "DATABASE_URL": database_url_for_tests(), "LOG_LEVEL": "WARNING",
           "DJANGO_SECRET_KEY": "test-suite-only", "METRICS_TOKEN": "t",
           "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_site.web", "--host", "127.0.0.1",
         "--port", str(SERVER_PORT), "--workers", "2", "--threads", "2"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    url = f"http://127.0.0.1:{SERVER_PORT}"

    def up() -> bool:
        try:
            return httpx.get(url + "/v1/agl/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, timeout=60, message="the server did not come up")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_request_counts_are_summed_across_server_processes(server_multiprocess):
    url = server_multiprocess
    with httpx.Client() as one, httpx.Client() as other:  # two connections: both workers serve
        for _ in range(10):
            one.get(url + "/v1/agl/health")
            other.get(url + "/v1/agl/health")
    text = httpx.get(url + "/metrics", headers={"Authorization": "Bearer t"}, timeout=30).text
    samples = _samples(text)
    served = samples[("lightning_http_requests_total", frozenset(
        {"route": "/v1/agl/health", "method": "GET", "status": "200"}.items()))]
    assert served >= 20  # plus the readiness probes
    assert ("lightning_rollouts" in text) and "process_cpu_seconds_total" not in text


def test_the_sample_dashboard_and_scrape_config_use_what_the_endpoint_serves(client, settings):
    settings.METRICS_TOKEN = "t"
    record_completion("tiny", prompt_tokens=1, completion_tokens=1, seconds=0.1)
    project = services.project_create(name="dash")
    enqueue(project, 1)
    client.get("/v1/agl/health")
    families = list(text_string_to_metric_families(
        client.get("/metrics", headers={"Authorization": "Bearer t"}).text))
    served = {f.name for f in families} | {s.name for f in families for s in f.samples}
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    used = {name for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"\blightning_[a-z_]+", target["expr"])}
    assert len(used) >= 12 and used <= served, used - served
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics"
    assert scrape["authorization"]["type"] == "Bearer"


def test_the_alert_rules_name_only_served_metrics_and_check(client, settings):
    """deploy/alerts.yml: each rule well formed, each metric it reads served (a run's scrape
    above), and `promtool check rules` passes where promtool is installed."""
    import shutil

    settings.METRICS_TOKEN = "t"
    project = services.project_create(name="alerting")
    enqueue(project, 1)
    client.get("/v1/agl/health")
    families = list(text_string_to_metric_families(
        client.get("/metrics", headers={"Authorization": "Bearer t"}).text))
    served = {f.name for f in families} | {s.name for f in families for s in f.samples}
    path = ROOT / "deploy" / "alerts.yml"
    rules = [rule for group in yaml.safe_load(path.read_text())["groups"]
             for rule in group["rules"]]
    assert len(rules) >= 5
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["alert"] and rule["expr"] and rule["annotations"]["summary"]
        used = set(re.findall(r"\blightning_[a-z_]+", rule["expr"]))
        assert used and used <= served, (rule["alert"], used - served)
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    assert {"web:8000", "gateway:4748", "flower:5555"} <= {
        target for job in config["scrape_configs"] for c in job["static_configs"]
        for target in c["targets"]}
    promtool = shutil.which("promtool")
    if promtool:
        checked = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                                 text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
