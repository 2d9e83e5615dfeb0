"""Prometheus metrics at `/metrics` (README "Operate").

Two kinds: per-request counters kept by each process (the middleware below; with gunicorn's
several workers they are shared through PROMETHEUS_MULTIPROC_DIR, prometheus-client's
multiprocess mode), and the store's state read from the database at scrape time (StoreCollector),
so every process serves the same numbers and no counter is lost when a worker restarts.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

from django.conf import settings
from django.db import connection
from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Sum, TextField
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from core.metrics import LATENCY_BUCKETS, process_metrics
from runners.selectors import queue_states
from store.models import Attempt, ResourceSet, Rollout, Span, UsageEntry
from store.statemachine import ATTEMPT_LIVE, QUEUED, ROLLOUT_TERMINAL, AttemptStatus
from trainer import selectors as trainer_selectors
from trainer.models import JobStatus, StepStatus, TrainingJob, TrainingStep

# Rollouts last from milliseconds (a test agent) to an hour (an agent's limit).
DURATION_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

http_requests = Counter(
    "lightning_http_requests", "HTTP requests served, by route pattern, method and status",
    ["route", "method", "status"],
)
http_latency = Histogram(
    "lightning_http_request_seconds", "Time to answer an HTTP request, by route pattern",
    ["route"], buckets=LATENCY_BUCKETS,
)


def _route(request: HttpRequest) -> str:
    """The URL pattern, not the path: one label value per route, whatever the ids."""
    match = getattr(request, "resolver_match", None)
    return f"/{match.route}" if match and match.route else "unmatched"


class RequestMetricsMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        started = time.perf_counter()
        response = self.get_response(request)
        route = _route(request)
        http_latency.labels(route).observe(time.perf_counter() - started)
        http_requests.labels(route, request.method, str(response.status_code)).inc()
        return response


def _gauge(name: str, documentation: str, labels: list[str],
           rows: Iterator[tuple[tuple[str, ...], float]],
           kind: type = GaugeMetricFamily) -> GaugeMetricFamily:
    family = kind(name, documentation, labels=labels)
    for label_values, value in rows:
        family.add_metric(list(label_values), value)
    return family


def _counter(name: str, documentation: str, labels: list[str],
             rows: Iterator[tuple[tuple[str, ...], float]]) -> CounterMetricFamily:
    """A counter read from the rows (monotonic while rows are kept)."""
    return _gauge(name, documentation, labels, rows, kind=CounterMetricFamily)


class StoreCollector(Collector):
    """The store's state, read at scrape time with grouped queries (one row per label set)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rollouts = list(Rollout.objects.values_list("project__name", "status")
                        .annotate(n=Count("pk")).order_by())
        yield _gauge("lightning_rollouts", "Rollouts by project and status",
                     ["project", "status"], (((p, s), n) for p, s, n in rollouts))
        depth: dict[str, int] = {}
        for project, status, n in rollouts:
            depth[project] = depth.get(project, 0) + (n if status in QUEUED else 0)
        yield _gauge("lightning_queue_depth", "Rollouts waiting in the queue, by project",
                     ["project"], (((p,), n) for p, n in depth.items()))
        attempts = Attempt.objects.values_list("status").annotate(
            n=Count("pk"), retries=Count("pk", filter=Q(sequence_id__gt=1))).order_by()
        attempts = list(attempts)
        yield _gauge("lightning_attempts", "Attempts by status (timeout and unresponsive are the "
                     "watchdog's verdicts)", ["status"], (((s,), n) for s, n, _ in attempts))
        yield _gauge("lightning_attempts_retried", "Attempts that are retries (sequence > 1)",
                     [], iter([((), sum(r for _, _, r in attempts))]))
        yield from self._resources_and_workers()
        yield from self._training()
        yield from self._spans()
        yield from self._durations()
        yield from self._finished()
        yield from self._step_history()
        yield from self._ledger()

    def _ledger(self) -> Iterator[CounterMetricFamily]:
        """The cost ledger's totals per project (append-only rows: counters)."""
        sums = list(UsageEntry.objects.values_list("project__name").annotate(
            cpu=Sum("cpu_seconds"), gpu=Sum("gpu_seconds"), tokens=Sum("tokens"),
            cost=Sum("cost")).order_by())
        for name, index, doc in (
            ("lightning_usage_cpu_seconds", 1, "CPU-seconds of attempts and training steps"),
            ("lightning_usage_gpu_seconds", 2, "GPU-seconds (wall x devices held)"),
            ("lightning_usage_tokens", 3, "Tokens the model gateway generated for attempts"),
            ("lightning_cost", 4, "Cost of the ledger's rows at the price list of their time"),
        ):
            yield _counter(name, f"{doc}, by project (the cost ledger)", ["project"],
                           (((row[0],), row[index]) for row in sums))

    def _finished(self) -> Iterator[CounterMetricFamily]:
        """Counters read from the rows (ended rows never change back), so rates come from
        `rate()` without diffing gauges: finished rollouts by final status, ended attempts by
        status, and the watchdog's verdicts (kept in the metadata when a late report revived
        the attempt). They fall only when rows are deleted (a project removed)."""
        rollouts = (Rollout.objects.filter(status__in=ROLLOUT_TERMINAL)
                    .values_list("project__name", "mode", "status")
                    .annotate(n=Count("pk")).order_by())
        yield _counter("lightning_rollouts_finished", "Rollouts that ended, by project, mode "
                       "and final status", ["project", "mode", "status"],
                       (((p, m or "", s), n) for p, m, s, n in rollouts))
        attempts = (Attempt.objects.exclude(status__in=ATTEMPT_LIVE).values_list("status")
                    .annotate(n=Count("pk")).order_by())
        yield _counter("lightning_attempts_ended", "Attempts that ended, by status (retries "
                       "are attempts past the first: lightning_attempts_retried)", ["status"],
                       (((s,), n) for s, n in attempts))
        lost = (AttemptStatus.TIMEOUT, AttemptStatus.UNRESPONSIVE)
        verdicts = (Attempt.objects
                    .filter(Q(status__in=lost) | Q(metadata__has_key="store.watchdog_verdict"))
                    .annotate(verdict=Coalesce(KeyTextTransform("store.watchdog_verdict",
                                                                "metadata"), F("status"),
                                               output_field=TextField()))
                    .values_list("verdict").annotate(n=Count("pk")).order_by())
        yield _counter("lightning_watchdog_verdicts", "Attempts the watchdog ended, by verdict "
                       "(timeout, unresponsive), a late report's revival included",
                       ["verdict"], (((v,), n) for v, n in verdicts))

    def _step_history(self) -> Iterator[HistogramMetricFamily]:
        """Every finished training step's seconds spent training, by job: the history the
        last-step gauges above do not keep."""
        done = (TrainingStep.objects.filter(status=StepStatus.DONE)
                .values_list("job_id", "timings"))
        by_job: dict[str, list[float]] = {}
        for job_id, timings in done.iterator(chunk_size=2000):
            seconds = (timings or {}).get("train_seconds")
            if isinstance(seconds, int | float):
                by_job.setdefault(str(job_id), []).append(float(seconds))
        family = HistogramMetricFamily("lightning_train_step_seconds", "Finished training "
                                       "steps: seconds spent training, by job", labels=["job"])
        for job, values in by_job.items():
            counts = [(str(float(b)), sum(1 for v in values if v <= b)) for b in DURATION_BUCKETS]
            family.add_metric([job], counts + [("+Inf", len(values))], sum_value=sum(values))
        yield family

    def _resources_and_workers(self) -> Iterator[GaugeMetricFamily]:
        versions = ResourceSet.objects.values_list("project__name", "resources_id", "version")
        yield _gauge("lightning_resource_versions", "Latest version number per resources id",
                     ["project", "resources_id"], (((p, r), v) for p, r, v in versions))
        states = queue_states()
        yield _gauge("lightning_workers_live", "Live Celery workers per queue",
                     ["queue"], (((q.queue,), len(q.live_workers)) for q in states))
        yield _gauge("lightning_workers_live_cuda", "Live Celery workers with CUDA per queue",
                     ["queue"], (((q.queue,), len(q.cuda_workers)) for q in states))
        yield _gauge("lightning_worker_slots_held_by_ended_attempts",
                     "Worker slots still running an agent whose attempt the store already ended "
                     "(freed within RUNNERS_STOP_GRACE_SECONDS in prefork pools)",
                     ["queue"], (((q.queue,), q.held_by_ended) for q in states))
        yield from _scaling(states)


    def _training(self) -> Iterator[GaugeMetricFamily]:
        wait, train = [], []
        for job in TrainingJob.objects.filter(status=JobStatus.RUNNING):
            done = [r for r in trainer_selectors.step_rows(job=job)
                    if r.step.status == StepStatus.DONE]
            if done:
                last = done[-1]
                if last.wait_seconds is not None:
                    wait.append(((str(job.pk),), last.wait_seconds))
                if "train_seconds" in last.step.timings:
                    train.append(((str(job.pk),), last.step.timings["train_seconds"]))
        yield _gauge("lightning_train_step_wait_seconds", "Last finished step of each running "
                     "job: seconds from planned to its rollouts done", ["job"], iter(wait))
        yield _gauge("lightning_train_step_train_seconds", "Last finished step of each running "
                     "job: seconds spent training", ["job"], iter(train))

    def _durations(self) -> Iterator[HistogramMetricFamily]:
        """Rollout duration (finished rollouts: enqueued to ended) and queue wait (enqueued to
        its first attempt), by project and mode: histograms read from the rows, so every
        process serves the same figures (they fall when store_retain deletes rows)."""
        finished = (Rollout.objects.filter(end_time__isnull=False, status__in=ROLLOUT_TERMINAL)
                    .annotate(seconds=ExpressionWrapper(F("end_time") - F("start_time"),
                                                        output_field=DurationField())))
        yield _histogram("lightning_rollout_duration_seconds", "Finished rollouts: seconds from "
                         "enqueued to ended, by project and mode", finished,
                         "project__name", "mode")
        first = (Attempt.objects.filter(sequence_id=1)
                 .annotate(seconds=ExpressionWrapper(F("start_time") - F("rollout__start_time"),
                                                     output_field=DurationField())))
        yield _histogram("lightning_rollout_queue_wait_seconds", "Rollouts: seconds from "
                         "enqueued to their first attempt, by project and mode", first,
                         "rollout__project__name", "rollout__mode")
        jobs = TrainingJob.objects.values_list("status").annotate(n=Count("pk")).order_by()
        yield _gauge("lightning_jobs", "Training jobs by status", ["status"],
                     (((s,), n) for s, n in jobs))

    def _spans(self) -> Iterator[GaugeMetricFamily]:
        if connection.vendor != "postgresql":
            return
        # Postgres' own count of rows written to the span table (COPY included): cumulative
        # like a counter, and free to read, unlike a count(*) over millions of spans.
        with connection.cursor() as cursor:
            cursor.execute("SELECT n_tup_ins FROM pg_stat_user_tables WHERE relname = %s",
                           [Span._meta.db_table])
            row = cursor.fetchone()
        if row:
            yield _gauge("lightning_spans_ingested", "Spans written to the store since its "
                         "statistics were reset (Postgres pg_stat_user_tables)", [],
                         iter([((), row[0])]))


def _scaling(states) -> Iterator[GaugeMetricFamily]:
    """The scaling signal per queue (core/scaling.py; KEDA reads the last one)."""
    loads = [(q.queue, q.load) for q in states if q.load is not None]
    for name, attr, doc in (
        ("lightning_queue_queued", "queued", "Work waiting for a worker of the queue"),
        ("lightning_queue_running", "running", "Work a worker of the queue is running"),
        ("lightning_queue_slots_live", "slots", "Slots (concurrency) of the queue's live workers"),
        ("lightning_desired_workers", "desired_workers", "Workers the queue wants: "
         "ceil((queued + running) / slots per worker), within SCALE_<QUEUE>_MIN/MAX_WORKERS"),
    ):
        yield _gauge(name, doc, ["queue"], (((q,), getattr(load, attr)) for q, load in loads))


def _histogram(name: str, documentation: str, rows, project: str,
               mode: str) -> HistogramMetricFamily:
    """One grouped query: per (project, mode), the count at or under each bucket, the total and
    the sum of `seconds`."""
    buckets = {f"le{i}": Count("pk", filter=Q(seconds__lte=timedelta(seconds=b)))
               for i, b in enumerate(DURATION_BUCKETS)}
    groups = (rows.values(project, mode)
              .annotate(total=Count("pk"), sum=Sum("seconds"), **buckets).order_by())
    family = HistogramMetricFamily(name, documentation, labels=["project", "mode"])
    for g in groups:
        counts = [(str(float(b)), g[f"le{i}"]) for i, b in enumerate(DURATION_BUCKETS)]
        total = g["sum"].total_seconds() if g["sum"] is not None else 0.0
        family.add_metric([g[project], g[mode] or ""], counts + [("+Inf", g["total"])],
                          sum_value=total)
    return family


_store_registry = CollectorRegistry(auto_describe=False)
_store_registry.register(StoreCollector())


def _allowed(request: HttpRequest) -> bool:
    if request.user.is_authenticated and request.user.is_staff:
        return True
    token = settings.METRICS_TOKEN
    header = request.headers.get("Authorization", "")
    return bool(token) and hmac.compare_digest(header.encode(), f"Bearer {token}".encode())


def metrics_view(request: HttpRequest) -> HttpResponse:
    if not _allowed(request):
        return HttpResponse("metrics need a staff login or 'Authorization: Bearer "
                            "$METRICS_TOKEN'\n", status=401, content_type="text/plain")
    body = process_metrics() + generate_latest(_store_registry)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
