"""One attempt end to end, against a `StoreGateway` (runners/gateway.py).

The same code runs under the Celery rollout task (LocalGateway) and the remote runner
(HttpGateway): fetch the pinned resources, run the agent in the calling thread while a watcher
thread heartbeats and ships spans in batches, emit the returned reward, and finish the attempt
`succeeded` or `failed` with the error recorded. When the store says the rollout was cancelled,
the agent is stopped: `RolloutInfo.cancelled` is set and `AttemptCancelled` is raised in the
agent's thread once it runs the agent's own code (runners/cancel_guard.py). When the store had
already ended the attempt (the watchdog's timeout), the agent is stopped the same way and
nothing is reported: the store's verdict stands ("ended"). An agent that raises is asked about
once: if the store had stopped its attempt by then (a cancelled rollout's LLM call is refused
before the next heartbeat tells the runner), the stop is its end, not a failure.
"""

from __future__ import annotations

import logging
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from django.db import connections

from runners.agent import Agent, RolloutInfo, call_agent, load_agent
from runners.agl_compat import call_agl_agent, is_agl_agent
from runners.cancel_guard import AttemptCancelled, CancelGuard
from runners.gateway import STOP_CANCELLED, STOP_ENDED, Claim, StoreGateway
from runners.llm import route_llm_resources
from runners.stopping import HeldSlots, Stopper, may_exit_process
from runners.tracing import AGL_ROLLOUT, attempt_tracing, emit_reward, tracer
from runners.usage import UsageMeter

log = logging.getLogger(__name__)

SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"
ENDED = "ended"  # the store ended the attempt (the watchdog's timeout): nothing reported
MAX_ERROR_CHARS = 8000
CANCELLED_ERROR = "cancelled: the rollout was cancelled while running"


@dataclass(frozen=True)
class ExecutorOptions:
    heartbeat_seconds: float = 5.0
    span_batch_size: int = 100
    # An agent still running this long after the store ended its attempt is given up on
    # (runners/stopping.py); `held` records its slot meanwhile.
    stop_grace_seconds: float = 5.0
    held: HeldSlots | None = None
    # Started when the task started (its claim included); None: when execute() starts.
    meter: UsageMeter | None = None


@dataclass(frozen=True)
class Outcome:
    status: str  # succeeded, failed, cancelled or ended
    reward: float | None = None
    error: str | None = None
    spans: int = 0


def execute(
    *, gateway: StoreGateway, claim: Claim, agent: Agent | str, worker_id: str,
    options: ExecutorOptions | None = None,
) -> Outcome:
    """Run one claimed attempt to its end and report it to the store. Whatever escapes before
    the report (Celery's soft time limit lands wherever the task happens to be: setting up
    tracing, shipping spans, even the report itself) is reported as the attempt's failure
    and raised again: a claimed attempt never stays live with nobody running it."""
    options = options or ExecutorOptions()
    meter = options.meter or UsageMeter()
    try:
        return _execute(gateway, claim, agent, worker_id, options, meter)
    except Exception as exc:
        gateway.finish(rollout_id=claim.rollout_id, attempt_id=claim.attempt_id,
                       status=FAILED, error=_describe(exc), usage=meter.read())
        raise


def _execute(gateway: StoreGateway, claim: Claim, agent: Agent | str, worker_id: str,
             options: ExecutorOptions, meter: UsageMeter) -> Outcome:
    info = RolloutInfo(
        rollout_id=claim.rollout_id, attempt_id=claim.attempt_id, mode=claim.mode,
        resources_id=claim.resources_id, resources_version=claim.resources_version,
        config=claim.config, metadata=claim.metadata, sequence_id=claim.sequence_id,
    )
    guard = CancelGuard(info)
    watcher = _Watcher(gateway, claim, worker_id, options.heartbeat_seconds, guard)
    with attempt_tracing(rollout_id=claim.rollout_id, attempt_id=claim.attempt_id,
                         batch_size=options.span_batch_size, on_full=watcher.wake) as spans:
        # No heartbeat before the agent starts: the claim just took a queued rollout, and the
        # first span batch or heartbeat (whichever comes first) moves the attempt to running.
        watcher.spans = spans
        watcher.stopper = Stopper(
            rollout_id=claim.rollout_id, attempt_id=claim.attempt_id,
            grace=options.stop_grace_seconds, running=guard.running, may_exit=may_exit_process(),
            held=options.held, before_exit=lambda: _ship_rest(gateway, spans),
        )
        watcher.start()
        try:
            outcome = _run(gateway, claim, agent, info, guard)
            if outcome.status == FAILED and _stopped_by_store(gateway, claim, worker_id, guard):
                # The agent failed after the store stopped its attempt, most likely because
                # of it (the model gateway refuses a cancelled rollout's calls, 409): the
                # stop is the attempt's end, not a failure of the agent's.
                log.info("attempt %s/%s: the agent failed after its rollout was stopped: %s",
                         claim.rollout_id, claim.attempt_id, last_line(outcome.error))
                outcome = Outcome(CANCELLED, error=f"{CANCELLED_ERROR} (the agent then failed:"
                                                   f" {last_line(outcome.error)})")
        finally:
            watcher.stop()
        if outcome.status == CANCELLED and guard.ended:
            # Stopped because the store had ended the attempt (timed out): the store's
            # verdict and its error stand; a report now would turn "timeout" into "failed".
            _ship_rest(gateway, spans)
            return Outcome(ENDED, error="the store ended the attempt while it ran",
                           spans=spans.count)
        rest = spans.take()
    outcome = Outcome(outcome.status, outcome.reward, outcome.error, spans.count)
    # The last spans travel with the verdict (one write where the gateway can make it one).
    gateway.finish(
        rollout_id=claim.rollout_id, attempt_id=claim.attempt_id,
        status=SUCCEEDED if outcome.status == SUCCEEDED else FAILED,
        error=outcome.error, usage=meter.read(), spans=rest,
    )
    return outcome


def _run(gateway: StoreGateway, claim: Claim, agent: Agent | str, info: RolloutInfo,
         guard: CancelGuard) -> Outcome:
    try:
        try:
            if guard.stop_requested:
                raise AttemptCancelled()
            resources = (
                gateway.resources(resources_id=claim.resources_id,
                                  version=claim.resources_version)
                if claim.resources_id else {}
            )
            resources = route_llm_resources(
                resources, rollout_id=claim.rollout_id, attempt_id=claim.attempt_id,
                api_key=gateway.llm_api_key(rollout_id=claim.rollout_id,
                                            attempt_id=claim.attempt_id),
            )
            fn = load_agent(agent) if isinstance(agent, str) else agent
            with tracer().start_as_current_span(
                AGL_ROLLOUT, attributes={"agentlightning.rollout_id": claim.rollout_id,
                                         "agentlightning.attempt_id": claim.attempt_id},
            ):
                guard.enter(fn)
                run = call_agl_agent if is_agl_agent(fn) else call_agent
                reward = run(fn, task=claim.input, resources=resources, rollout=info)
                guard.leave()
                if reward is not None:
                    emit_reward(reward)
        finally:
            guard.leave()
    except AttemptCancelled:
        return Outcome(CANCELLED, error=CANCELLED_ERROR)
    except Exception as exc:  # the agent's failure is the attempt's failure, recorded
        log.info("attempt %s/%s failed: %r", claim.rollout_id, claim.attempt_id, exc)
        return Outcome(FAILED, error=_describe(exc))
    return Outcome(SUCCEEDED, reward=reward)


def _stopped_by_store(gateway: StoreGateway, claim: Claim, worker_id: str,
                      guard: CancelGuard) -> bool:
    """Whether the store had stopped the attempt (its rollout cancelled, or the attempt
    ended) by the time its agent failed: known already (the watcher's last tick), else asked
    once (a heartbeat: it answers why to stop). A store that cannot be reached says no."""
    if guard.stop_requested:
        return True
    try:
        stop = gateway.heartbeat(rollout_id=claim.rollout_id, attempt_id=claim.attempt_id,
                                 worker_id=worker_id)
    except Exception:
        log.debug("could not ask the store whether %s/%s was stopped", claim.rollout_id,
                  claim.attempt_id, exc_info=True)
        return False
    if stop:
        guard.cancel(ended=stop == STOP_ENDED)  # the agent has returned: nothing is raised
    return bool(stop)


def last_line(error: str | None) -> str:
    """The exception line of a traceback: what Flower shows as the task's result."""
    lines = [line for line in (error or "").splitlines() if line.strip()]
    return lines[-1] if lines else "failed"


def _ship_rest(gateway: StoreGateway, spans: Any) -> None:
    batch = spans.take()
    while batch:
        gateway.add_spans(spans=batch)
        batch = spans.take()


def _describe(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc))
    return text if len(text) <= MAX_ERROR_CHARS else "..." + text[-MAX_ERROR_CHARS:]


class _Watcher(threading.Thread):
    """Heartbeats the attempt and ships its spans while the agent runs."""

    def __init__(self, gateway: StoreGateway, claim: Claim, worker_id: str, interval: float,
                 guard: CancelGuard) -> None:
        super().__init__(name=f"heartbeat-{claim.attempt_id}", daemon=True)
        self.gateway = gateway
        self.claim = claim
        self.worker_id = worker_id
        self.interval = interval
        self.guard = guard
        self.spans: Any = None
        self.stopper: Stopper | None = None
        self._wake = threading.Event()
        self._done = threading.Event()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._done.set()
        self._wake.set()
        self.join()
        if self.stopper is not None:
            self.stopper.close()

    def run(self) -> None:
        try:
            while not self._done.is_set():
                self._wake.wait(self.interval)
                self._wake.clear()
                if self._done.is_set():
                    break
                try:
                    self._tick()
                except Exception:  # the store is unreachable: try again at the next tick
                    log.exception("heartbeat of %s/%s failed", self.claim.rollout_id,
                                  self.claim.attempt_id)
        finally:
            connections.close_all()  # this thread's own database connections, if any

    def _tick(self) -> None:
        batch = self.spans.take()
        if batch:
            try:
                cancelled = self.claim.rollout_id in self.gateway.add_spans(spans=batch)
                stop = STOP_CANCELLED if cancelled else None
            except Exception:
                self.spans.put_back(batch)
                raise
        else:
            stop = self.gateway.heartbeat(rollout_id=self.claim.rollout_id,
                                          attempt_id=self.claim.attempt_id,
                                          worker_id=self.worker_id)
        if stop:
            self.guard.cancel(ended=stop == STOP_ENDED)
            if self.stopper is not None:
                self.stopper.ended()
