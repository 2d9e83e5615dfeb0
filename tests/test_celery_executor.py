"""The executor end to end against LocalGateway on the real database (no broker involved)."""

from __future__ import annotations

import threading

import pytest
from django.db import OperationalError

from core.retry import RetryPolicy
from runners import executor
from runners import services as runner_services
from runners.agent import AgentError, load_agent
from runners.executor import ExecutorOptions
from runners.local_gateway import LocalGateway
from runners.tracing import AGL_ANNOTATION, AGL_MESSAGE
from store import selectors, services
from store.models import Span
from store.services import RolloutSpec
from tests.celery_agents import CountingAgent
from tests.celery_fixtures import wait_until

pytestmark = pytest.mark.django_db(transaction=True)
FAST = ExecutorOptions(heartbeat_seconds=0.05, span_batch_size=2)


def run_one(project, agent, *, input=None, resources_id=None, options=FAST):
    services.rollout_enqueue(project=project, spec=RolloutSpec(input=input or {"i": 3},
                                                              resources_id=resources_id))
    gateway = LocalGateway(project)
    claim = gateway.claim(worker_id="w-test")[0]
    outcome = executor.execute(gateway=gateway, claim=claim, agent=agent, worker_id="w-test",
                               options=options)
    rollout = selectors.rollout_get(project=project, rollout_id=claim.rollout_id)
    return outcome, rollout


def test_agent_reward_and_instrumented_spans_are_recorded(project):
    outcome, rollout = run_one(project, "tests.celery_agents:ok_agent")
    assert outcome.status == "succeeded" and outcome.reward == 3.0
    assert rollout.status == "succeeded"
    assert rollout.latest_attempt.status == "succeeded"
    spans = {s.name: s for s in Span.objects.filter(rollout=rollout)}
    assert set(spans) == {"llm.call", AGL_MESSAGE, AGL_ANNOTATION, "agentlightning.rollout"}
    reward = spans[AGL_ANNOTATION]
    assert reward.attributes["agentlightning.reward.0.name"] == "primary"
    assert reward.attributes["agentlightning.reward.0.value"] == 3.0
    root = spans["agentlightning.rollout"]
    assert spans["llm.call"].parent_id == root.span_id
    assert spans["llm.call"].trace_id == root.trace_id and len(root.trace_id) == 32
    assert len(root.span_id) == 16 and root.parent_id is None
    assert spans["llm.call"].attributes["gen_ai.prompt"] == "question 3"
    assert sorted(s.sequence_id for s in spans.values()) == [1, 2, 3, 4]
    resource = root.resource["attributes"]
    assert resource["agentlightning.attempt_id"] == rollout.latest_attempt.attempt_id


def test_a_retried_rollouts_spans_continue_its_sequence_ids(project):
    config = {"max_attempts": 2, "retry_condition": ["failed"]}
    services.rollout_enqueue(project=project, spec=RolloutSpec(input={"i": 1}, config=config))
    gateway = LocalGateway(project)
    for agent in ("tests.celery_agents:failing_agent", "tests.celery_agents:ok_agent"):
        claim = gateway.claim(worker_id="w-test")[0]
        executor.execute(gateway=gateway, claim=claim, agent=agent, worker_id="w-test",
                         options=FAST)
    ids = list(Span.objects.order_by("sequence_id").values_list("sequence_id", "attempt_id"))
    assert [seq for seq, _ in ids] == list(range(1, len(ids) + 1))  # one counter, no repeats
    assert len({attempt for _, attempt in ids}) == 2


def test_span_dicts_follow_the_agl_schema(project):
    run_one(project, "tests.celery_agents:ok_agent")
    span = Span.objects.get(name="llm.call")
    assert span.status == {"status_code": "UNSET", "description": None}
    assert span.context["trace_id"] == span.trace_id and span.context["is_remote"] is False
    assert span.parent["span_id"] == span.parent_id
    assert span.start_time <= span.end_time and span.events == [] and span.links == []


def test_a_span_from_an_unpropagated_thread_still_belongs_to_the_attempt(project):
    outcome, rollout = run_one(project, "tests.celery_agents:threaded_agent")
    assert outcome.status == "succeeded"
    assert Span.objects.filter(rollout=rollout, name="in.thread").exists()


def test_agent_exception_fails_the_attempt_with_the_error_recorded(project):
    outcome, rollout = run_one(project, "tests.celery_agents:failing_agent")
    assert outcome.status == "failed"
    assert rollout.status == "failed"
    assert "ValueError: bad input" in rollout.latest_attempt.metadata["error"]


@pytest.mark.parametrize("agent, input, says", [
    ("tests.celery_agents:ok_agent", {"i": "nan"}, "reward 'primary' must be a finite number, "
                                                   "got nan"),
    ("tests.celery_agents:ok_agent", {"i": "-inf"}, "reward 'primary' must be a finite number, "
                                                    "got -inf"),
    ("tests.celery_agents:emitting_agent", {"x": "inf"}, "reward 'other' must be a finite "
                                                         "number, got inf"),
])
def test_a_reward_that_is_not_a_finite_number_fails_the_attempt_saying_so(project, agent, input,
                                                                         says):
    """A NaN reward failed the attempt with a database error about invalid JSON (SQLite), or
    would have become a span no store can hold; now the agent's attempt says what it did."""
    outcome, rollout = run_one(project, agent, input=input)
    assert (outcome.status, rollout.status) == ("failed", "failed")
    error = rollout.latest_attempt.metadata["error"]
    assert f"ValueError: {says}" in error and "IntegrityError" not in error
    assert not Span.objects.filter(rollout=rollout, name=AGL_ANNOTATION).exists()


def test_unknown_agent_fails_the_attempt(project):
    outcome, rollout = run_one(project, "tests.celery_agents:no_such_agent")
    assert rollout.status == "failed"
    assert "no_such_agent" in rollout.latest_attempt.metadata["error"]


def test_resources_are_given_by_name(project):
    version = services.resources_add(
        project=project, resources={"llm": {"resource_type": "llm", "endpoint": "http://x/v1"}}
    )
    outcome, _ = run_one(project, "tests.celery_agents:llm_agent",
                         input={"endpoint": "http://x/v1"}, resources_id=version.resource_set.resources_id)
    assert outcome.reward == 1.0


def test_class_agents_are_instantiated_once(project):
    assert isinstance(load_agent("tests.celery_agents.CountingAgent"), CountingAgent)
    assert load_agent("tests.celery_agents:CountingAgent") is load_agent(
        "tests.celery_agents:CountingAgent"
    )
    outcome, _ = run_one(project, "tests.celery_agents:CountingAgent")
    assert outcome.reward == 2.0


def test_bad_agent_paths_are_refused():
    with pytest.raises(AgentError):
        load_agent("nodots")


def test_cancellation_stops_a_running_agent(project):
    services.rollout_enqueue(project=project, spec=RolloutSpec(input={"seconds": 60}))
    gateway = LocalGateway(project)
    claim = gateway.claim(worker_id="w-test")[0]
    result = {}

    def run() -> None:
        result["outcome"] = executor.execute(
            gateway=gateway, claim=claim, agent="tests.celery_agents:looping_agent",
            worker_id="w-test", options=FAST,
        )

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: selectors.rollout_get(project=project, rollout_id=claim.rollout_id)
               .status == "running", timeout=30)
    services.rollout_update(project=project, rollout_id=claim.rollout_id, status="cancelled")
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert result["outcome"].status == "cancelled"
    rollout = selectors.rollout_get(project=project, rollout_id=claim.rollout_id)
    assert rollout.status == "cancelled"
    assert rollout.latest_attempt.status == "failed"
    assert "cancelled" in rollout.latest_attempt.metadata["error"]


def test_an_agent_failing_after_its_rollout_was_cancelled_ends_cancelled_not_failed(project):
    """An asynchronous job's re-planned rollouts: the agent's LLM call is refused (409) once
    the trainer cancelled the rollout, and the agent raises before the runner's watcher saw
    the cancellation. That is the stop, not a failure: no RolloutFailed (Celery logged each
    as an ERROR with a traceback), the attempt's error says it was cancelled."""
    slow = ExecutorOptions(heartbeat_seconds=30, span_batch_size=100)  # the watcher sees nothing
    outcome, rollout = run_one(project, "tests.celery_agents:fails_once_cancelled_agent",
                               options=slow)
    assert outcome.status == "cancelled"
    assert rollout.status == "cancelled" and rollout.latest_attempt.status == "failed"
    error = rollout.latest_attempt.metadata["error"]
    assert error.startswith("cancelled: the rollout was cancelled while running")
    assert "RuntimeError: 409 Conflict" in error


@pytest.mark.django_db  # inside the test's transaction: nothing commits, nothing is sent
def test_enqueue_for_celery_sends_only_after_commit(project, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        rollouts = runner_services.rollouts_enqueue_for_celery(
            project=project, specs=[RolloutSpec(input={"i": 1})],
            agent="tests.celery_agents:ok_agent",
        )
    assert len(callbacks) == 1
    rollout = selectors.rollout_get(project=project, rollout_id=rollouts[0].pk)
    assert (rollout.dispatch, rollout.dispatch_target) == ("celery", "tests.celery_agents:ok_agent")
    assert rollout.config["unresponsive_seconds"] == 120.0


def test_the_in_process_gateway_finishes_through_a_lost_database_connection(project):
    """Finding 2: one OperationalError while finishing made the task's autoretry re-run it;
    the re-run claimed nothing and the sweep later failed a rollout whose agent succeeded.
    Here the gateway's own connection is killed by the server before the finish."""
    from core.retry import RetryPolicy
    from tests.conftest import terminate_backend

    services.rollout_enqueue(project=project, spec=RolloutSpec(input={"i": 1}))
    gateway = LocalGateway(project, retry=RetryPolicy(retries=3, backoff=0.01))
    claim = gateway.claim(worker_id="w-test")[0]
    terminate_backend()
    gateway.finish(rollout_id=claim.rollout_id, attempt_id=claim.attempt_id, status="succeeded")
    rollout = selectors.rollout_get(project=project, rollout_id=claim.rollout_id)
    assert rollout.status == "succeeded" and rollout.latest_attempt.status == "succeeded"


def test_a_redelivered_message_takes_over_from_a_dead_process_on_the_same_node(project):
    """Fast takeover: after kill -9 of a worker's child, Celery redelivered the message, but
    the redelivery returned 'not-queued' (the dead child's attempt held the rollout) and the
    rollout waited for the watchdog's unresponsive limit."""
    import os
    import subprocess

    rollout = services.rollout_enqueue(project=project, spec=RolloutSpec(input={"i": 2}, config={
        "unresponsive_seconds": 120, "max_attempts": 2, "retry_condition": ["unresponsive"]}))
    services.rollout_dispatch_set(project=project, rollout_ids=[rollout.pk], dispatch="celery",
                                  target="tests.celery_agents:ok_agent")
    dead = subprocess.Popen(["true"])
    dead.wait()
    services.rollout_claim(project=project, rollout_id=rollout.pk,
                           worker_id=f"celery:rollouts@node1:{dead.pid}")
    here = f"celery:rollouts@node1:{os.getpid()}"
    # A holder on another node (its pid means nothing here) is left to the watchdog.
    assert runner_services.rollout_run(project_id=project.pk, rollout_id=rollout.pk,
                                       worker_id="celery:rollouts@node2:1") == "not-queued"
    assert runner_services.rollout_run(project_id=project.pk, rollout_id=rollout.pk,
                                       worker_id=here) == "succeeded"
    rollout = selectors.rollout_get(project=project, rollout_id=rollout.pk)
    assert rollout.status == "succeeded" and rollout.attempt_count == 2
    first = rollout.attempts.get(sequence_id=1)
    assert first.status == "unresponsive"


def test_whatever_escapes_the_executor_is_reported_as_the_attempts_failure(project,
                                                                            monkeypatch):
    """Celery's soft time limit lands wherever the task is, not only inside the agent: seen
    landing before the agent ran, it left the attempt live with nobody running it (the test
    of the soft limit was flaky under load)."""
    def interrupted(*args, **kwargs):
        raise RuntimeError("interrupted outside the agent")

    monkeypatch.setattr(executor, "attempt_tracing", interrupted)
    services.rollout_enqueue(project=project, spec=RolloutSpec(input={"i": 1}))
    gateway = LocalGateway(project)
    claim = gateway.claim(worker_id="w-test")[0]
    with pytest.raises(RuntimeError):
        executor.execute(gateway=gateway, claim=claim, agent="tests.celery_agents:ok_agent",
                         worker_id="w-test", options=FAST)
    rollout = selectors.rollout_get(project=project, rollout_id=claim.rollout_id)
    assert rollout.status == "failed"
    assert "interrupted outside the agent" in rollout.latest_attempt.metadata["error"]


def test_a_task_interrupted_before_its_claim_owes_the_rollout_a_message(project, monkeypatch):
    rollout = services.rollout_enqueue(project=project, spec=RolloutSpec(input={"i": 1}))
    services.rollout_dispatch_set(project=project, rollout_ids=[rollout.pk], dispatch="celery",
                                  target="tests.celery_agents:ok_agent")

    def interrupted(*args, **kwargs):
        raise RuntimeError("soft time limit")

    monkeypatch.setattr(LocalGateway, "claim_rollout", interrupted)
    monkeypatch.setattr(LocalGateway, "claim_next", interrupted)  # the ticket's claim
    with pytest.raises(RuntimeError):
        runner_services.rollout_run(project_id=project.pk, rollout_id=rollout.pk, worker_id="w")
    due = services.rollout_dispatch_due(resend_after_seconds=300, limit=5)
    assert [d.rollout_id for d in due] == [rollout.pk]


@pytest.mark.parametrize("named", [True, False])
def test_a_claim_whose_answer_was_lost_is_adopted_by_its_retry(project, monkeypatch, named):
    """The claim committed, then the connection dropped before its answer came back: the
    retry finds the rollout no longer queued. It adopts the attempt that carries its own
    worker id instead of reporting 'not queued' and leaving it held by nobody."""
    rollout = services.rollout_enqueue(project=project, spec=RolloutSpec(input={"i": 1}))
    name = "rollout_claim" if named else "rollout_dequeue_many"
    real, committed = getattr(services, name), []

    def commit_then_lose_the_answer(**kwargs):
        result = real(**kwargs)
        if not committed:
            committed.append(result)
            raise OperationalError("server closed the connection unexpectedly")
        return result

    monkeypatch.setattr(services, name, commit_then_lose_the_answer)
    gateway = LocalGateway(project, retry=RetryPolicy(retries=2, backoff=0.01))
    if named:
        claim = gateway.claim_rollout(rollout_id=rollout.pk, worker_id="w-lost")
    else:
        claim = next(iter(gateway.claim(worker_id="w-lost")), None)
    assert committed and claim is not None and claim.rollout_id == rollout.pk
    attempt = selectors.rollout_get(project=project, rollout_id=rollout.pk).latest_attempt
    assert (attempt.attempt_id, attempt.sequence_id, attempt.worker_id) == (
        claim.attempt_id, 1, "w-lost")


def test_a_retried_dequeue_never_adopts_an_attempt_the_worker_already_runs(project, monkeypatch):
    """A runner with several slots claims under one worker id: an attempt it claimed before
    (still preparing, its agent starting) is not the lost answer of this dequeue."""
    services.rollout_enqueue_many(project=project, specs=[RolloutSpec(input={"i": i})
                                                          for i in range(2)])
    gateway = LocalGateway(project, retry=RetryPolicy(retries=2, backoff=0.01))
    running = gateway.claim(worker_id="w-slots")[0]
    real, failed = services.rollout_dequeue_many, []

    def fail_once_before_committing(**kwargs):
        if not failed:
            failed.append(True)
            raise OperationalError("server closed the connection unexpectedly")
        return real(**kwargs)

    monkeypatch.setattr(services, "rollout_dequeue_many", fail_once_before_committing)
    again = gateway.claim(worker_id="w-slots")
    assert failed and len(again) == 1 and again[0].rollout_id != running.rollout_id
