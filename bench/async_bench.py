"""Asynchronous against synchronous training on a long-tailed agent. Prints figures; asserts
nothing.

    .venv/bin/python bench/async_bench.py [--example cipher|llm] [--steps 12] [--bound 2]
        [--concurrency 64] [--median 0.5] [--sigma 1.2] [--consume groups|step] [--spare 8]

The same job runs twice in this process: `--example cipher` (the default), the cipher-MLP
GRPO job, or `--example llm`, the LLM example (examples/llm_cipher: a tiny GPT-2 trained with
grpo_lm, every episode a real call through the model gateway, which runs in this process;
embedded default only), each with the example's config, `--steps` training steps (default
12 and 40), validation every 4 and after the last update, `max_staleness=0` then
`max_staleness=--bound` (consuming by `--consume`, default groups, with `--spare` spare
groups, default the job's: half a step's groups), with an agent whose episodes sleep a
lognormal time drawn from the rollout's seed (`--median` seconds, `--sigma`: p99 / p50 =
e^(2.33 sigma), 16x at 1.2) before decoding (or calling the model): what is measured is the
scheduling, not the agent.
Embedded default (SQLite in a temporary LIGHTNING_DATA_DIR, in-process workers:
`--concurrency` rollout threads, one training thread) unless DATABASE_URL and CELERY_BROKER_URL
are set; then the deployment's database and broker with worker processes started here (`celery
worker -Q rollouts -c --concurrency` and `-Q training -c 1`).

For each run: wall time from the job's start to its last step done, the rollout workers' busy
fraction (attempt seconds / (wall x slots)), the training worker's busy fraction (train seconds
/ wall), the staleness of the samples used, the means over the training steps of the
off-policy metrics (staleness, stale tokens, importance weights, the engine's logprob
rounding), the gateway's seconds per LLM call (its spans; LLM example), and the validation
reward per step (measured on the version the step's rollouts pinned) and the mean of the last
three validations. Last line, exactly (one line):

    async speedup=<wall_sync/wall_async> max_staleness_seen=<k> bound=<s>
    reward_sync=<r> reward_async=<r>
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The agent's sleep (read from the environment so worker processes draw the same ones).
MEDIAN = float(os.environ.get("ASYNC_BENCH_MEDIAN", "0.5"))
SIGMA = float(os.environ.get("ASYNC_BENCH_SIGMA", "1.2"))


def episode_seconds(seed: int) -> float:
    """A lognormal duration drawn from the rollout's seed (capped at 60 s)."""
    rng = random.Random(seed * 7919 + 17)
    return min(MEDIAN * math.exp(rng.gauss(0.0, SIGMA)), 60.0)


def long_tail_agent(task, resources) -> None:
    """The cipher agent after a heavy-tailed sleep (validation episodes included)."""
    from examples.cipher.agent import cipher_agent

    time.sleep(episode_seconds(int(task["seed"])))
    cipher_agent(task, resources)


def long_tail_llm_agent(task, llm) -> float:
    """The LLM example's agent (examples/llm_cipher: a real call through the gateway) after a
    heavy-tailed sleep."""
    from examples.llm_cipher.agent import recall_agent

    time.sleep(episode_seconds(int(task["seed"])))
    return recall_agent(task, llm)


# --example: (the job spec's module, the long-tailed agent, default steps, validation every)
EXAMPLES = {
    "cipher": ("examples.cipher", "bench.async_bench.long_tail_agent", 12, 4),
    # 40: the synchronous run reaches 1.0 at version 29 and keeps it, so the async run's final
    # reward is compared with a converged one, not with where a trajectory happens to be
    # (README "Benchmarks")
    "llm": ("examples.llm_cipher", "bench.async_bench.long_tail_llm_agent", 40, 4),
}


def _setup(distributed: bool) -> None:
    if not distributed:
        for name in ("DATABASE_URL", "CELERY_BROKER_URL"):
            os.environ.pop(name, None)
        os.environ["LIGHTNING_DATA_DIR"] = tempfile.mkdtemp(prefix="async-bench-")
    # the LLM example's warm-started model is built once, outside the timed runs, and kept
    os.environ.setdefault("LIGHTNING_MODELS_DIR",
                          str(Path(tempfile.gettempdir()) / "async-bench-models"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _create(example: str, steps: int, bound: int, consume: str = "groups",
            spare: int | None = None) -> int:
    import importlib

    from store import services as store_services
    from trainer import services

    module, agent, _, val_every = EXAMPLES[example]
    spec = importlib.import_module(module).job_spec(seed=0, steps=steps)
    spec["config"].update(max_staleness=bound, val_every=val_every)
    if bound:
        spec["config"]["consume"] = consume
        if consume == "groups" and spare is not None:
            spec["config"]["spare_groups"] = spare
    project = store_services.project_create(name=f"async-bench-{uuid.uuid4().hex[:8]}")
    return services.job_create(
        project=project, agent=agent, algorithm=spec["algorithm"],
        config=spec["config"], train_dataset=spec["train_dataset"],
        val_dataset=spec["val_dataset"],
    ).pk


def _run(job_id: int) -> float:
    from trainer import services
    from trainer.models import JOB_TERMINAL, TrainingJob

    started = time.perf_counter()
    services.job_start(job_id=job_id)
    while TrainingJob.objects.get(pk=job_id).status not in JOB_TERMINAL:
        time.sleep(0.1)
    return time.perf_counter() - started


def _report(job_id: int, wall: float, slots: int) -> dict:
    from store.models import Attempt
    from trainer import selectors
    from trainer.models import TrainingJob

    job = TrainingJob.objects.get(pk=job_id)
    bound = job.config["max_staleness"]
    steps = list(job.steps.order_by("n"))
    attempts = Attempt.objects.filter(rollout__in=selectors.job_rollouts(job=job),
                                      end_time__isnull=False)
    busy = sum((a.end_time - a.start_time).total_seconds() for a in attempts)
    trained = sum(s.timings.get("train_seconds", 0.0) for s in steps)
    seen = max((s.metrics.get("staleness_max", 0) for s in steps), default=0)
    replanned = sum(s.stale_rollouts for s in steps)
    borrowed = sum(s.metrics.get("groups_borrowed", 0) for s in steps)
    groups = sum(s.metrics.get("groups_trained", 0) for s in steps)
    durations = sorted(episode_seconds(int(a.rollout.input["seed"]))
                       for a in attempts.select_related("rollout"))
    p50, p99 = durations[len(durations) // 2], durations[int(len(durations) * 0.99)]
    tag = f"[max_staleness={bound}]"
    print(f"{tag} job {job.pk} {job.status}{'' if job.status == 'succeeded' else job.error}")
    print(f"{tag} wall time to {len(steps) - 1} training steps + final evaluation: {wall:.1f}s")
    print(f"{tag} rollout workers busy {busy / (wall * slots):.1%} ({len(durations)} "
          f"episodes, {slots} slots; episode sleep p50 {p50:.2f}s p99 {p99:.2f}s = "
          f"{p99 / p50:.1f}x)")
    print(f"{tag} training worker busy {trained / wall:.1%} ({trained:.1f}s training)")
    print(f"{tag} staleness of samples used: max {seen}, rollouts planned again (past the "
          f"bound) {replanned}" + (f", groups trained {groups} of which planned by another step "
                            f"{borrowed}" if groups else "")
          + (f", spare groups {job.config.get('spare_groups')} (None: half a step's), left "
             f"untrained at the end {job.surplus_groups}" if groups else ""))
    waits = _waits(steps)
    print(f"{tag} wait for what a step trains on once its turn came (ready - max(previous "
          f"step done, planned)): step 0 {waits[0]:.1f}s, steps 1-{len(steps) - 2} median "
          f"{statistics.median(waits[1:-1]):.1f}s, last training step {waits[-2]:.1f}s, "
          f"final evaluation {waits[-1]:.1f}s")
    _off_policy(tag, steps)
    _llm_calls(tag, job)
    rewards = "  ".join(f"{s.n}:{s.metrics['val_reward']:.3f}@v{s.resources_version}"
                        for s in steps if "val_reward" in s.metrics)
    print(f"{tag} validation reward per step (step:reward@version) {rewards}")
    # The final validation alone flips by a digit between validations once a run has learned
    # (README "Benchmarks": 0.9 and 1.0 in both modes); the last three say where it sits.
    last = [s.metrics["val_reward"] for s in steps if "val_reward" in s.metrics][-3:]
    print(f"{tag} validation reward, mean of the last {len(last)} validations "
          f"{statistics.mean(last):.3f}")
    return {"wall": wall, "seen": seen, "reward": steps[-1].metrics.get("val_reward", 0.0)}


def _off_policy(tag: str, steps: list) -> None:
    """Means over the training steps of the staleness and importance-weight metrics."""
    keys = ("staleness_mean", "stale_token_fraction", "is_weight_mean", "is_weight_max",
            "is_weight_truncated_fraction", "recorded_logprob_max_diff")
    means = {k: statistics.mean(vs) for k in keys
             if (vs := [s.metrics[k] for s in steps if k in s.metrics])}
    if means:
        print(f"{tag} per training step, mean: "
              + ", ".join(f"{k} {v:.3g}" for k, v in means.items()))


def _llm_calls(tag: str, job) -> None:
    """How long the gateway took per LLM call (its spans), beside the episodes' sleeps."""
    from store.models import Span
    from trainer import conventions, selectors

    times = sorted(end - start for start, end in Span.objects.filter(
        rollout__in=selectors.job_rollouts(job=job), name=conventions.LLM_CALL_SPAN,
        start_time__isnull=False, end_time__isnull=False).values_list("start_time", "end_time"))
    if times:
        print(f"{tag} LLM calls {len(times)}: gateway seconds per call p50 "
              f"{times[len(times) // 2]:.2f} p90 {times[int(len(times) * 0.9)]:.2f} "
              f"mean {statistics.mean(times):.2f}")


def _waits(steps: list) -> list[float]:
    """Per step, seconds from when it could start (the previous step done, or its planning if
    later; step 0: its planning) to ready: the wait for its groups and validation."""
    def at(step, key):
        return datetime.fromisoformat(step.timings[key])

    waits = []
    for n, step in enumerate(steps):
        start = at(step, "planned") if n == 0 else max(at(steps[n - 1], "done"),
                                                       at(step, "planned"))
        waits.append((at(step, "ready") - start).total_seconds())
    return waits


def _workers(slots: int) -> list[subprocess.Popen]:
    processes = []
    for queue, concurrency in (("rollouts", slots), ("training", 1)):
        log = open(Path(tempfile.gettempdir()) / f"async-bench-{queue}.log", "wb")  # noqa: SIM115
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "lightning_site", "worker", "-Q", queue,
             "-c", str(concurrency), "-P", "threads" if queue == "rollouts" else "prefork",
             "-n", f"async-bench-{queue}-{uuid.uuid4().hex[:6]}@%h", "--without-gossip",
             "--without-mingle", "-l", "WARNING"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        ))
    time.sleep(8)  # let both workers connect before the first message (not measured)
    return processes


def main(example: str, steps: int, bound: int, slots: int, consume: str = "groups",
         spare: int | None = None) -> None:
    distributed = bool(os.environ.get("DATABASE_URL") and os.environ.get("CELERY_BROKER_URL"))
    if distributed and example == "llm":
        raise SystemExit("--example llm runs on the embedded default only (its gateway runs "
                         "in this process): unset DATABASE_URL or CELERY_BROKER_URL")
    _setup(distributed)
    what = "cipher MLP, GRPO" if example == "cipher" else "LLM example (GPT-2 tiny), grpo_lm"
    print(f"async bench: {what}, {steps} steps, "
          f"{'distributed' if distributed else 'embedded default'}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    results = {}
    for s in (0, bound):
        job_id = _create(example, steps, s, consume, spare)
        if distributed:
            workers = _workers(slots)
            try:
                wall = _run(job_id)
            finally:
                for process in workers:
                    os.killpg(process.pid, signal.SIGTERM)
                    process.wait(timeout=60)
        else:
            from contextlib import ExitStack

            from core.embedded import embedded_workers
            from trainer.llm.embedded import embedded_gateway

            with ExitStack() as stack:
                if example == "llm":
                    stack.enter_context(embedded_gateway())
                stack.enter_context(embedded_workers(concurrency={"rollouts": slots}))
                wall = _run(job_id)
        results[s] = _report(job_id, wall, slots)
    sync, fast = results[0], results[bound]
    print(f"async speedup={sync['wall'] / fast['wall']:.2f} max_staleness_seen={fast['seen']} "
          f"bound={bound} reward_sync={sync['reward']:.3f} reward_async={fast['reward']:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--example", choices=sorted(EXAMPLES), default="cipher")
    parser.add_argument("--steps", type=int, help="default: 12 (cipher), 40 (llm)")
    parser.add_argument("--bound", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64, help="rollout slots")
    parser.add_argument("--median", type=float, default=MEDIAN)
    parser.add_argument("--sigma", type=float, default=SIGMA)
    parser.add_argument("--consume", choices=["groups", "step"], default="groups",
                        help="the async job's rule (README: what a step trains on)")
    parser.add_argument("--spare", type=int,
                        help="the async job's spare_groups (default: the job's default)")
    args = parser.parse_args()
    os.environ["ASYNC_BENCH_MEDIAN"], os.environ["ASYNC_BENCH_SIGMA"] = (
        str(args.median), str(args.sigma))
    MEDIAN, SIGMA = args.median, args.sigma
    main(args.example, args.steps or EXAMPLES[args.example][2], args.bound, args.concurrency,
         args.consume, args.spare)
