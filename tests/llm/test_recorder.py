"""The gateway's recorder, tenants in turn (issue 22): one project's backlog of calls to store
neither goes before another project's call nor holds the writer it needs. A's write is held
by a real row lock (a second Postgres connection locking A's attempt), as a write of A's
waiting for its locks would be."""

from __future__ import annotations

import time

from django.db import transaction

from store import services
from store.models import Attempt, Span
from trainer.llm import calls
from trainer.llm.engine import Params, Sequence_

from .test_gateway import MESSAGES, started_attempt


def _call() -> calls.Call:
    choice = Sequence_([1, 2, 3], Params(max_tokens=2), token_ids=[4, 5], logprobs=[-0.1, -0.2],
                       top=[[], []], text="ab", finish_reason="length")
    now = time.time()
    return calls.Call(kind="chat", model="tiny", version=1,
                      request={"model": "tiny", "messages": MESSAGES}, prompt_ids=[1, 2, 3],
                      choices=[choice], started=now, finished=now,
                      response_id=calls.response_id("chat", None))


def _attribution(project) -> calls.Attribution:
    rid, aid = started_attempt(project)
    return calls.Attribution(project, rid, aid, None)


def _writing(pending: calls.Pending) -> None:
    """Until a writer took `pending` (its write then waits for the test's lock)."""
    for _ in range(3000):
        if pending.began:
            return
        time.sleep(0.01)
    raise AssertionError("no writer took the call")


def _span_pk(pending: calls.Pending) -> int:
    return Span.objects.get(span_id=pending.spans[0]["span_id"]).pk


def test_a_backlog_of_one_project_waits_its_turn_behind_another_projects_call(keyed):
    """One writer, A's write held: 40 more calls of A queue, then B's one, then 20 of C's.
    B's call is the next turn (before any of A's backlog), not after all of A's calls as
    with one queue for all tenants; A and C then take turns of at most 16 calls while the
    other waits, and the last one left writes the rest of its calls at once."""
    project, _, other, _ = keyed
    third = services.project_create(name="llm-third")
    a, b, c = _attribution(project), _attribution(other), _attribution(third)
    recorder = calls.Recorder(writers=1, turn_calls=16)
    try:
        with transaction.atomic():
            Attempt.objects.select_for_update().get(rollout_id=a.rollout_id,
                                                    attempt_id=a.attempt_id)
            first = recorder.submit(a, _call())
            _writing(first)
            backlog = [recorder.submit(a, _call()) for _ in range(40)]
            b_call = recorder.submit(b, _call())
            c_calls = [recorder.submit(c, _call()) for _ in range(20)]
        for pending in [first, *backlog, b_call, *c_calls]:
            assert pending.done.wait(60) and pending.error is None
    finally:
        recorder.close()
    assert b_call.group == 1 and b_call.began < min(p.began for p in backlog + c_calls)
    assert [p.group for p in c_calls] == [16] * 16 + [4] * 4
    assert [p.group for p in backlog] == [16] * 16 + [24] * 24
    turns = sorted({(p.began, name) for name, ps in (("a", backlog), ("c", c_calls))
                    for p in ps})
    assert [name for _, name in turns] == ["c", "a", "c", "a"]
    assert _span_pk(first) < _span_pk(b_call) < min(_span_pk(p) for p in backlog)
    stored = [_span_pk(p) for p in backlog]
    assert stored == sorted(stored)  # a project's calls are stored in the order they came


def test_another_projects_call_is_stored_while_a_projects_write_waits(keyed):
    """Two writers: while A's write waits for a lock, B's call takes the other writer and is
    stored; A's is stored once the lock is released."""
    project, _, other, _ = keyed
    a, b = _attribution(project), _attribution(other)
    recorder = calls.Recorder(writers=2, turn_calls=16)
    try:
        with transaction.atomic():
            Attempt.objects.select_for_update().get(rollout_id=a.rollout_id,
                                                    attempt_id=a.attempt_id)
            a_call = recorder.submit(a, _call())
            _writing(a_call)
            more_a = recorder.submit(a, _call())  # A's next turn: not a second writer of A
            b_call = recorder.submit(b, _call())
            assert b_call.done.wait(60) and b_call.error is None
            assert not a_call.done.is_set() and not more_a.began
        assert a_call.done.wait(60) and a_call.error is None
        assert more_a.done.wait(60) and more_a.error is None
    finally:
        recorder.close()
    assert Span.objects.filter(rollout_id=b.rollout_id).count() == 1
    assert Span.objects.filter(rollout_id=a.rollout_id).count() == 2
    assert _span_pk(a_call) < _span_pk(more_a)
