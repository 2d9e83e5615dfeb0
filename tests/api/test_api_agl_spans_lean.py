"""The lean paths of an unmodified AGL 0.3 runner's per-span requests (store/api/fastjson.py):
`POST /v1/agl/spans/next` and `POST /v1/agl/spans` answer exactly what Django's path answers
(status, headers, body), in-process and through the real server (the ASGI front under
uvicorn), and leave everything else to Django (None) having stored nothing. Sequence ids
stay strictly increasing per rollout under 16 concurrent writers over HTTP."""

from __future__ import annotations

import json
import os
import threading
from collections import defaultdict

import pytest
from django.test import Client
from django.urls import resolve
from django.utils import timezone

from store import services
from store.api import fastjson, fastpath, limits
from store.models import ApiKey, Rollout, Span
from tests.api.conftest import Server, http
from tests.conftest import claim, enqueue

pytestmark = pytest.mark.django_db(transaction=True)
JSON = "application/json"
SPANS = fastjson.SPANS_PATH
NEXT = fastjson.NEXT_SPAN_PATH
_SERVER_ONLY = ("content-length", "date", "server")  # uvicorn's own headers


def _span(rollout_id: str, attempt_id: str, /, **fields) -> dict:
    span = {"rollout_id": rollout_id, "attempt_id": attempt_id, "trace_id": "ab" * 16,
            "span_id": os.urandom(8).hex(), "parent_id": None, "name": "llm.call",
            "status": {"status_code": "OK", "description": None},
            "attributes": {"gen_ai.prompt": "é\u2028", "n": 3, "f": 0.25},
            "events": [], "links": [], "start_time": 1700000000.5, "end_time": 1700000001,
            "context": {"trace_id": "ab" * 16}, "parent": None,
            "resource": {"attributes": {"service.name": "agl"}, "schema_url": ""}}
    span.update(fields)
    return {k: v for k, v in span.items() if v is not _DROP}


_DROP = object()


def _lean(key: str, path: str, body: bytes, **extra: str):
    headers = {b"content-type": JSON.encode(), b"host": b"127.0.0.1", b"accept": b"*/*",
               b"authorization": f"Bearer {key}".encode()}
    headers.update({k.encode(): v.encode() for k, v in extra.items()})
    lean = fastjson.route("POST", path, b"")
    assert lean is not None and lean[0] == path
    answer = lean[1](headers, path, body)
    if type(answer) is fastpath.OnThread:  # what the front then runs on a thread
        answer = answer.handler(headers, path, body)
    if answer is None:
        return None
    status, pairs, content = answer
    return _comparable(status, [(k.decode(), v.decode()) for k, v in pairs], content)


def _django(key: str, path: str, body: bytes):
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key}", HTTP_HOST="127.0.0.1")
    answer = client.post(path, data=body, content_type=JSON)
    return _comparable(answer.status_code, answer.headers.items(), answer.content)


def _served(server: Server, key: str, path: str, body: bytes):
    with http(server, key) as client:
        answer = client.post(server.url + path, content=body,
                             headers={"Content-Type": JSON, "Accept": "*/*"})
    return _comparable(answer.status_code, answer.headers.items(), answer.content)


def _comparable(status: int, headers, body: bytes) -> tuple:
    return status, {k.lower(): v for k, v in headers if k.lower() not in _SERVER_ONLY}, body


def _as(answer: tuple, ids: dict[str, str]) -> tuple:
    """The answer with one rollout's ids written as another's."""
    status, headers, body = answer
    for mine, theirs in ids.items():
        body = body.replace(mine.encode(), theirs.encode())
        headers = {k: v.replace(mine, theirs) for k, v in headers.items()}
    return status, headers, body


@pytest.fixture
def key(project) -> str:
    return services.api_key_create(project=project, role="runner")[1]


def _three(project) -> list[tuple[str, str]]:
    """Three claimed rollouts in the same state: one each for the lean path, the server and
    Django's path."""
    enqueue(project, 3, config={"timeout_seconds": 60})
    return [(r.pk, a.attempt_id) for r, a in (claim(project) for _ in range(3))]


def _state(project) -> tuple:
    rollouts = Rollout.objects.filter(project=project).order_by("pk")
    return (sorted(rollouts.values_list("pk", "next_span_sequence_id", "status")),
            Span.objects.count())


def test_routes_are_the_urls_django_resolves():
    for path in (SPANS, NEXT):
        assert "/" + resolve(path).route == path
        assert fastjson.route("POST", path, b"")[0] == path
    for method, path, query in [
        ("GET", SPANS, b""),  # query_spans
        ("POST", SPANS, b"x=1"),
        ("POST", NEXT, b"x=1"),
        ("POST", SPANS + "/batch", b""),
        ("POST", SPANS + "/search", b""),
        ("POST", NEXT + "/", b""),
    ]:
        assert fastjson.route(method, path, query) is None, (method, path, query)


@pytest.mark.parametrize("body", [
    {},  # AGL's client sends both ids; Django needs them
    {"attempt_id": "at-nope"},  # any attempt id of a known rollout will do, as in AGL
    {"extra": [1]},
    {"attempt_id": "at-\u00e9\u2028 "},  # not plain ASCII: the serializer's fields accept it
    {"attempt_id": "a" * 40},  # the longest id
])
def test_next_sequence_id_answers_what_django_answers(api_server, project, key, body):
    ids = _three(project)
    answers = []
    for (rollout_id, attempt_id), ask in zip(ids, ("lean", "server", "django"), strict=True):
        raw = json.dumps({"rollout_id": rollout_id, "attempt_id": attempt_id, **body}).encode()
        for _ in range(2):  # the second id of each rollout too
            if ask == "lean":
                answer = _lean(key, NEXT, raw)
                assert answer is not None
            elif ask == "server":
                answer = _served(api_server, key, NEXT, raw)
            else:
                answer = _django(key, NEXT, raw)
        answers.append(answer)
    assert answers[0] == answers[1] == answers[2]
    assert answers[0][0] == 200 and json.loads(answers[0][2])["sequence_id"] >= 0
    counters = set(Rollout.objects.filter(project=project).values_list(
        "next_span_sequence_id", flat=True))
    assert len(counters) == 1


@pytest.mark.parametrize("fields", [
    {},  # AGL's runner: the id from spans/next
    {"sequence_id": None},  # the attempt's next id
    {"sequence_id": _DROP},
    {"sequence_id": 41, "x-extra": {"kept": True}},  # a higher explicit id moves the counter
    {"parent_id": "cd" * 8, "attributes": None, "status": None, "resource": None},
    {"start_time": 5, "end_time": None, "events": [{"name": "e", "attributes": {}}]},
])
def test_add_span_answers_what_django_answers(api_server, project, key, fields):
    ids = _three(project)
    django_ids = ids[2]
    span_id = "ef" * 8
    answers = []
    for rollout_id, attempt_id in ids:
        seq = services.span_next_sequence_id(project=project, rollout_id=rollout_id,
                                             attempt_id=attempt_id)
        span = _span(rollout_id, attempt_id, **{"span_id": span_id, "sequence_id": seq,
                                                **fields})
        answers.append(json.dumps(span).encode())
    lean = _lean(key, SPANS, answers[0])
    assert lean is not None
    served = _served(api_server, key, SPANS, answers[1])
    slow = _django(key, SPANS, answers[2])
    assert slow[0] == 201, slow
    mapping = [dict(zip(ids[i], django_ids, strict=True)) for i in range(2)]
    assert _as(lean, mapping[0]) == slow
    assert _as(served, mapping[1]) == slow
    # The stored spans are the same, and so are the counters.
    stored = [Span.objects.get(rollout_id=rid) for rid, _ in ids]
    assert len({(s.sequence_id, s.name, json.dumps(s.attributes), json.dumps(s.extra))
                for s in stored}) == 1
    assert len(set(Rollout.objects.filter(project=project).values_list(
        "next_span_sequence_id", "status"))) == 1
    # A repeated post is a duplicate: 201 and `null`, from each path alike.
    again = [_lean(key, SPANS, answers[0]), _served(api_server, key, SPANS, answers[1]),
             _django(key, SPANS, answers[2])]
    assert again[0] == again[1] == again[2] and again[0][2] == b"null"
    assert Span.objects.count() == 3


def test_a_cancelled_rollout_is_named_as_django_names_it(api_server, project, key):
    ids = _three(project)
    for rollout_id, _ in ids:
        services.rollout_update(project=project, rollout_id=rollout_id, status="cancelled")
    bodies = [json.dumps(_span(rid, aid, span_id="01" * 8)).encode() for rid, aid in ids]
    lean = _lean(key, SPANS, bodies[0])
    assert lean is not None and lean[1]["x-cancelled-rollouts"] == ids[0][0]
    served = _served(api_server, key, SPANS, bodies[1])
    slow = _django(key, SPANS, bodies[2])
    assert _as(lean, dict(zip(ids[0], ids[2], strict=True))) == slow
    assert _as(served, dict(zip(ids[1], ids[2], strict=True))) == slow


def _bad_spans(rid: str, aid: str, other: tuple[str, str]) -> list[bytes]:
    def dumps(**fields) -> bytes:
        return json.dumps(_span(rid, aid, **fields)).encode()

    many = {f"a{i}": i for i in range(limits.MAX_ATTRIBUTES_PER_SPAN + 1)}
    return [
        b'{"rollout_id": "' + rid.encode() + b'"',  # malformed JSON
        b"", b"null", b"[]", b"\xff", b'{"name": NaN}',
        dumps(name=_DROP), dumps(span_id=_DROP), dumps(trace_id=""),  # missing fields
        dumps(rollout_id=_DROP), dumps(attempt_id=_DROP),
        dumps(name=5), dumps(sequence_id="1"), dumps(sequence_id=True),  # wrong types
        dumps(sequence_id=1.5), dumps(sequence_id=2**31), dumps(attributes=[1]),
        dumps(start_time="x"), dumps(end_time=True), dumps(resource="r"),
        dumps(span_id="a" * 33), dumps(name="a\u0000b"),
        dumps(attributes=many),  # 413
        dumps(attributes={"a": "x" * (limits.MAX_ATTRIBUTE_LENGTH + 1)}),
        dumps(rollout_id="ro-nope"), dumps(attempt_id="at-nope"),  # unknown: 404
        json.dumps(_span(*other)).encode(),  # another project's ids: 404
        json.dumps(_span(rid, other[1])).encode(),
    ]


def _bad_next(rid: str, aid: str, other: tuple[str, str]) -> list[bytes]:
    return [
        b'{"rollout_id": "' + rid.encode() + b'"', b"", b"null", b"[]", b'{"x": NaN}',
        json.dumps({"attempt_id": aid}).encode(),  # missing
        json.dumps({"rollout_id": rid}).encode(),
        json.dumps({"rollout_id": 5, "attempt_id": aid}).encode(),  # wrong types
        json.dumps({"rollout_id": rid, "attempt_id": None}).encode(),
        json.dumps({"rollout_id": [rid], "attempt_id": aid}).encode(),
        json.dumps({"rollout_id": "r" * 300, "attempt_id": aid}).encode(),
        # What the plain-id check (fastjson._plain_id) leaves to the serializer's fields:
        json.dumps({"rollout_id": rid, "attempt_id": ""}).encode(),  # blank
        json.dumps({"rollout_id": rid, "attempt_id": "a" * 41}).encode(),  # one too long
        json.dumps({"rollout_id": rid, "attempt_id": "a\u0000b"}).encode(),  # NUL
        b'{"rollout_id": "' + rid.encode() + b'", "attempt_id": "\\ud800"}',  # surrogate
        json.dumps({"rollout_id": True, "attempt_id": aid}).encode(),
        json.dumps({"rollout_id": "ro-nope", "attempt_id": aid}).encode(),  # unknown: 404
        json.dumps({"rollout_id": other[0], "attempt_id": other[1]}).encode(),  # other project
    ]


@pytest.mark.parametrize("path", [SPANS, NEXT])
def test_anything_else_is_left_to_django_and_stores_nothing(api_server, project, key,
                                                            other_project, path):
    enqueue(project, 1)
    rid, aid = (lambda r, a: (r.pk, a.attempt_id))(*claim(project))
    enqueue(other_project, 1)
    other = (lambda r, a: (r.pk, a.attempt_id))(*claim(other_project))
    before = _state(project), _state(other_project)
    bodies = (_bad_spans if path == SPANS else _bad_next)(rid, aid, other)
    statuses = set()
    for body in bodies:
        assert _lean(key, path, body) is None, body
        assert (_state(project), _state(other_project)) == before, body
        slow = _django(key, path, body)
        assert _served(api_server, key, path, body) == slow, body
        assert slow[0] >= 400, (body, slow)
        statuses.add(slow[0])
    assert (_state(project), _state(other_project)) == before
    assert {400, 404} <= statuses
    # Headers and the like that Django words differently: left to it too.
    good = (json.dumps(_span(rid, aid)) if path == SPANS
            else json.dumps({"rollout_id": rid, "attempt_id": aid})).encode()
    for headers in ({"content-type": "text/plain"}, {"accept": "text/html"},
                    {"host": "evil.example"}, {"authorization": "Bearer agl_nope"},
                    {"content-encoding": "gzip"}):
        assert _lean(key, path, good, **headers) is None, headers
    assert (_state(project), _state(other_project)) == before


def test_an_unresponsive_attempt_is_left_to_django_which_revives_it(project, key):
    enqueue(project, 1)
    rollout, attempt = claim(project)
    attempt.status = "unresponsive"
    attempt.save(update_fields=["status"])
    body = json.dumps(_span(rollout.pk, attempt.attempt_id)).encode()
    assert _lean(key, SPANS, body) is None
    assert Span.objects.count() == 0
    assert _django(key, SPANS, body)[0] == 201
    attempt.refresh_from_db()
    assert attempt.status == "running"


@pytest.mark.parametrize("path", [SPANS, NEXT])
def test_a_revoked_key_is_refused_as_django_refuses_it(api_server, project, key, path):
    enqueue(project, 1)
    rid, aid = (lambda r, a: (r.pk, a.attempt_id))(*claim(project))

    def body() -> bytes:
        return (json.dumps(_span(rid, aid)) if path == SPANS
                else json.dumps({"rollout_id": rid, "attempt_id": aid})).encode()

    # The key is known to this process and to the server's: cached by the lean paths.
    assert _lean(key, path, body()) is not None
    for _ in range(4):  # both server processes, most likely
        assert _served(api_server, key, path, body())[0] in (200, 201)
    ApiKey.objects.filter(prefix=key[:12]).update(revoked_at=timezone.now())
    before = _state(project)
    raw = body()
    assert _lean(key, path, raw) is None
    assert _state(project) == before
    slow = _django(key, path, raw)
    assert slow[0] == 401
    for _ in range(4):
        assert _served(api_server, key, path, raw) == slow
    assert _state(project) == before


def test_sequence_ids_stay_strictly_increasing_under_16_concurrent_writers(
        api_server, project, key):
    """AGL's runner per span: spans/next, then spans with that id; half the writers leave
    the id to the store instead. 16 threads over HTTP on two rollouts."""
    enqueue(project, 2)
    targets = [(r.pk, a.attempt_id) for r, a in (claim(project) for _ in range(2))]
    per_thread, errors = 12, []
    got: dict[int, list[tuple[str, int]]] = defaultdict(list)

    def writer(index: int) -> None:
        rid, aid = targets[index % 2]
        try:
            with http(api_server, key) as client:
                for _ in range(per_thread):
                    span = _span(rid, aid)
                    if index % 4 < 2:
                        answer = client.post("/spans/next",
                                             json={"rollout_id": rid, "attempt_id": aid})
                        assert answer.status_code == 200, answer.text
                        span["sequence_id"] = answer.json()["sequence_id"]
                    else:
                        span.pop("sequence_id", None)
                    answer = client.post("/spans", json=span)
                    assert answer.status_code == 201, answer.text
                    stored = answer.json()["sequence_id"]
                    if "sequence_id" in span:
                        assert stored == span["sequence_id"]
                    got[index].append((rid, stored))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    for index, pairs in got.items():  # each writer's ids rise
        seqs = [seq for _, seq in pairs]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), (index, seqs)
    for rid, _ in targets:  # no id given twice in a rollout
        stored = list(Span.objects.filter(rollout_id=rid).values_list("sequence_id", flat=True))
        assert len(stored) == 8 * per_thread
        assert len(set(stored)) == len(stored)
        handed = sorted(seq for pairs in got.values() for r, seq in pairs if r == rid)
        assert handed == sorted(stored)
        counter = Rollout.objects.get(pk=rid).next_span_sequence_id
        assert counter > max(stored)


def test_spans_next_that_must_be_durable_is_left_to_a_thread(project, key):
    """On the event loop only a reservation within the rollout's reserve (an asynchronous
    commit): past it the inline call stores nothing and answers OnThread, whose handler
    (on a thread) reserves with a synchronous commit and moves the reserve; in another span
    epoch (after a crash), the counter first skips to the reserve."""
    from datetime import UTC, datetime

    from django.db.models import F

    from store.rules import SPAN_ID_BLOCK
    from store.services._rows import server_epoch

    assert server_epoch() is not None  # started in autocommit (as a lean request's first call)
    enqueue(project, 1)
    rollout, attempt = claim(project)
    body = json.dumps({"rollout_id": rollout.pk, "attempt_id": attempt.attempt_id}).encode()
    headers = {b"content-type": JSON.encode(), b"host": b"127.0.0.1",
               b"authorization": f"Bearer {key}".encode()}
    assert rollout.span_epoch is not None  # set at enqueue: the first ids need no flush
    assert fastjson.next_span_sequence_id(headers, NEXT, body)[2] == b'{"sequence_id":1}'
    Rollout.objects.filter(pk=rollout.pk).update(next_span_sequence_id=F("span_ids_reserved"))
    reserve = 1 + SPAN_ID_BLOCK
    answer = fastjson.next_span_sequence_id(headers, NEXT, body)
    assert type(answer) is fastpath.OnThread
    rollout.refresh_from_db()
    assert (rollout.next_span_sequence_id, rollout.span_ids_reserved) == (reserve, reserve)
    assert answer.handler(headers, NEXT, body)[2] == b'{"sequence_id":%d}' % reserve
    rollout.refresh_from_db()
    assert rollout.span_ids_reserved == reserve + 1 + SPAN_ID_BLOCK
    assert fastjson.next_span_sequence_id(headers, NEXT, body)[2] == (
        b'{"sequence_id":%d}' % (reserve + 1))
    Rollout.objects.filter(pk=rollout.pk).update(span_epoch=datetime(2000, 1, 1, tzinfo=UTC))
    assert type(fastjson.next_span_sequence_id(headers, NEXT, body)) is fastpath.OnThread
    skipped = reserve + 1 + SPAN_ID_BLOCK
    assert _django(key, NEXT, body)[2] == b'{"sequence_id":%d}' % skipped
