"""An LLM call as a span of its attempt: who it belongs to (attribution) and what is recorded.

Attribution follows AGL 0.3's LLM proxy: the base URL `/rollout/{rid}/attempt/{aid}/v1` or the
`x-rollout-id` / `x-attempt-id` headers. The rollout and attempt must belong to the caller's
project (else: not found) and the attempt must still be open (else: finished). Each returned
choice is recorded as one span named as AGL's triplet adapter expects (trainer.conventions),
with the prompt and response token ids, per-token log-probabilities, the checkpoint version
that generated it, finish reason, usage and latency. A retried request (same idempotency key)
gets the same span ids, which the store keeps once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import secrets
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import connection

from store import services as store_services
from store.errors import NotFound
from store.models import Attempt, Project, ResourceVersion, Rollout, Span
from store.statemachine import ATTEMPT_ENDED, ROLLOUT_TERMINAL
from trainer import conventions as c
from trainer.llm.engine import Sequence_
from trainer.llm.tools import Output

log = logging.getLogger(__name__)
# Seconds a call waits for its spans to be stored before it fails.
RECORD_TIMEOUT = 60.0


class AttemptFinished(Exception):
    """The attributed attempt (or its rollout) already ended: its calls cannot be recorded."""


@dataclass(frozen=True)
class Attribution:
    project: Project
    rollout_id: str
    attempt_id: str
    llm: dict[str, Any] | None  # the `llm` resource the rollout pinned, if any
    resources_id: str | None = None


def attribute(*, project: Project, rollout_id: str, attempt_id: str,
              live_key: store_services.LiveKey | None = None) -> Attribution:
    """The call's attempt, found open in the project. With `live_key` (a key from the lean
    cache, store/api/auth.py), the same statement checks that key: KeyNotLive unless it is
    live."""
    row = _attempt_row(project.pk, rollout_id, attempt_id, live_key)
    if row is None:
        if not Rollout.objects.filter(project=project, pk=rollout_id).exists():
            raise NotFound("rollout", rollout_id)
        raise NotFound("attempt", f"{rollout_id}/{attempt_id}")
    attempt_status, rollout_status, resources_id, resources_version, metadata = row
    if attempt_status in ATTEMPT_ENDED or rollout_status in ROLLOUT_TERMINAL:
        raise AttemptFinished(f"attempt {rollout_id}/{attempt_id} is {attempt_status} "
                              f"(rollout {rollout_status}); its calls are no longer recorded")
    if _serves_latest(metadata):  # a partial rollout: each call on the newest version
        resources_version = None
    return Attribution(project, rollout_id, attempt_id,
                       _pinned_llm(project.pk, resources_id, resources_version), resources_id)


def _serves_latest(metadata: Any) -> bool:
    """The rollout's metadata (a dict, or its JSON text from a raw cursor) asks for the newest
    version on each call (conventions.LLM_LATEST)."""
    if isinstance(metadata, str | bytes):
        if c.LLM_LATEST.encode() not in (metadata if isinstance(metadata, bytes)
                                         else metadata.encode()):
            return False
        metadata = json.loads(metadata)
    return isinstance(metadata, dict) and metadata.get(c.LLM_LATEST) is True


@functools.cache
def _attempt_sql(key_checked: bool = False) -> str:
    """One hand-written SELECT, built once from the models (compiling the equivalent
    queryset cost more CPU than the rest of a call: store/services/_rows.py does the same).
    `key_checked`: its first column says whether the key (pk, role) is live, and it has a
    row (the others NULL) when the attempt is not found."""
    a, r = Attempt._meta, Rollout._meta

    def col(meta, name: str) -> str:
        return f'"{meta.get_field(name).column}"'

    select = (
        f"SELECT a.{col(a, 'status')}, r.{col(r, 'status')}, r.{col(r, 'resources_id')}, "
        f"r.{col(r, 'resources_version')}, r.{col(r, 'metadata')} FROM \"{a.db_table}\" a "
        f"JOIN \"{r.db_table}\" r ON a.{col(a, 'rollout')} = r.{col(r, 'id')} "
        f"WHERE r.{col(r, 'id')} = %s AND r.{col(r, 'project')} = %s "
        f"AND a.{col(a, 'attempt_id')} = %s"
    )
    if not key_checked:
        return select
    return (f"SELECT {store_services.KEY_LIVE_SQL}, x.* FROM (SELECT 1) one "
            f"LEFT JOIN ({select}) x ON true")


def _attempt_row(project_id: int, rollout_id: str, attempt_id: str,
                 live_key: store_services.LiveKey | None = None) -> tuple | None:
    with connection.cursor() as cursor:
        cursor.execute(_attempt_sql(live_key is not None),
                       [*(live_key or ()), rollout_id, project_id, attempt_id])
        row = cursor.fetchone()
    if live_key is None:
        return row
    if not row[0]:
        raise store_services.KeyNotLive(live_key[0])
    return None if row[1] is None else row[1:]


# A resources version never changes: its llm resource is looked up once per process.
_PINNED_MAX = 256
_pinned: dict[tuple[int, str, int], dict[str, Any] | None] = {}


def _pinned_llm(project_id: int, resources_id: str | None,
                version: int | None) -> dict[str, Any] | None:
    if not resources_id:
        return None
    key = (project_id, resources_id, version)
    if version is not None and key in _pinned:
        return _pinned[key]
    versions = ResourceVersion.objects.filter(
        resource_set__project_id=project_id, resource_set__resources_id=resources_id)
    row = (versions.filter(version=version).first() if version is not None else
           versions.order_by("-version").first())
    llm = llm_resource(row.resources) if row is not None else None
    if version is not None and row is not None:
        if len(_pinned) >= _PINNED_MAX:
            _pinned.clear()
        _pinned[key] = llm
    return llm


class NotYourCheckpoint(Exception):
    """A published `llm` resource names a checkpoint that is not one of the project's jobs'."""


_CHECKPOINT_NAME = re.compile(r"jobs/(\d+)/step-[^/]+")
_owned: dict[tuple[int, int], bool] = {}


def check_checkpoint(llm: dict[str, Any], project_id: int) -> None:
    """A checkpoint the gateway may load for `project_id`: in the checkpoint storage, under
    `jobs/<id>/` of one of the project's own training jobs (trainer/services.py names them so).
    Anything else (another project's job, a path of its own, another storage) is refused: a
    key must not make the gateway read or serve weights its project did not train."""
    from trainer.checkpoints import STORAGE_ALIAS
    from trainer.models import TrainingJob

    checkpoint = llm.get("checkpoint")
    if not isinstance(checkpoint, dict):
        raise NotYourCheckpoint("the llm resource's checkpoint is not an object")
    name = checkpoint.get("name")
    match = _CHECKPOINT_NAME.fullmatch(name) if isinstance(name, str) else None
    if checkpoint.get("storage", STORAGE_ALIAS) != STORAGE_ALIAS or match is None:
        raise NotYourCheckpoint(f"checkpoint {name!r} is not a training job's checkpoint "
                                f"(jobs/<id>/step-... in storage {STORAGE_ALIAS!r})")
    key = (project_id, int(match.group(1)))
    if key not in _owned:
        if len(_owned) >= _PINNED_MAX:
            _owned.clear()
        _owned[key] = TrainingJob.objects.filter(pk=key[1], project_id=project_id).exists()
    if not _owned[key]:
        raise NotYourCheckpoint(f"checkpoint {name!r} belongs to no training job of this "
                                f"project")


def llm_resource(resources: dict[str, Any]) -> dict[str, Any] | None:
    """The LLM resource among a version's resources (the first served by this gateway)."""
    for value in resources.values():
        if (isinstance(value, dict) and value.get("resource_type") in ("llm", "proxy_llm")
                and value.get("checkpoint")):
            return value
    return None


@dataclass
class Call:
    """What one request asked and got, to record."""

    kind: str  # "chat" or "completion"
    model: str
    version: int
    request: dict[str, Any]
    prompt_ids: list[int]
    choices: list[Sequence_]
    started: float
    finished: float
    response_id: str
    idempotency_key: str | None = None
    token_text: Any = None  # callable: token id -> its text (for logprobs.content)
    request_sha256: str | None = None  # binds the idempotency key to this body
    outputs: dict[int, Output] = field(default_factory=dict)  # as the client got each choice
    # True: the prompt does not extend the attempt's previous call (re-tokenized); None: no
    # previous call (or a retry of it).
    retokenized: bool | None = None


def response_id(kind: str, key: str | None) -> str:
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    if key:
        return prefix + hashlib.sha256(key.encode()).hexdigest()[:24]
    return prefix + secrets.token_hex(12)


class KeyReused(Exception):
    """An idempotency key already recorded for this attempt with another request body."""


def request_sha256(body: dict[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def check_key(attribution: Attribution, key: str, digest: str) -> None:
    """A retried request (same key) must carry the same body: else its answer would go out
    under the first call's response id and the store would keep a mix of both calls."""
    span_id = _keyed_ids(attribution.attempt_id, key, 0)[1]
    stored = (Span.objects.filter(attempt__rollout_id=attribution.rollout_id,
                                  attempt__attempt_id=attribution.attempt_id, span_id=span_id)
              .values_list("attributes", flat=True).first())
    if stored is not None and stored.get(c.LLM_REQUEST_SHA256, digest) != digest:
        raise KeyReused(f"the idempotency key {key!r} was used for another request body "
                        f"in this attempt; use a new key for a new request")


def _keyed_ids(attempt_id: str, key: str, index: int) -> tuple[str, str]:
    digest = hashlib.sha256(f"{attempt_id}:{key}:{index}".encode()).hexdigest()
    return digest[:32], digest[32:48]


def record(attribution: Attribution, call: Call) -> None:
    store_services.spans_ingest(project=attribution.project, spans=spans_of(attribution, call))


def spans_of(attribution: Attribution, call: Call) -> list[dict[str, Any]]:
    return [_span(attribution, call, i, choice) for i, choice in enumerate(call.choices)]


class Recorder:
    """Group commit, tenants in turn: each project's calls queue apart, and `writers` threads
    take the projects in turn (round robin); a turn stores one project's oldest calls, at most
    `turn_calls` of them while another project waits (else all), in one store write (one
    transaction), and each caller returns once its spans are stored. A project is written by
    one writer at a time (its calls are stored in the order they came), so with two writers
    or more another project's call takes a free writer instead of waiting behind a flood's
    write, and with more projects than writers it waits for at most one bounded turn of each
    project before it (README "The model gateway"). A write that fails is retried call by
    call, so one bad call does not fail the others."""

    def __init__(self, *, writers: int = 2, turn_calls: int = 16) -> None:
        if writers < 1 or turn_calls < 1:
            raise ValueError("a recorder needs at least one writer and one call a turn")
        self.turn_calls = turn_calls
        self._cond = threading.Condition()
        self._queues: dict[int, deque[Pending]] = {}  # per project, oldest first
        self._turns: deque[int] = deque()  # projects with calls queued and no writer, in turn
        self._closing = False
        self.writes = 0
        self._threads = [threading.Thread(target=self._loop, name=f"llm-recorder-{i}",
                                          daemon=True) for i in range(writers)]
        for thread in self._threads:
            thread.start()

    def record(self, attribution: Attribution, call: Call,
               timeout: float = RECORD_TIMEOUT) -> None:
        pending = self.submit(attribution, call)
        if not pending.done.wait(timeout):
            raise TimeoutError("the store did not record the call in time")
        if pending.error is not None:
            raise pending.error

    def submit(self, attribution: Attribution, call: Call,
               on_done: Callable[[Pending], None] | None = None) -> Pending:
        """Queue the call's spans; `on_done(pending)` is called on a writer's thread once
        they are stored or failed (`pending.error`)."""
        pending = Pending(attribution, spans_of(attribution, call), on_done=on_done)
        project_id = attribution.project.pk
        with self._cond:
            queued = self._queues.get(project_id)
            if queued is None:  # no call queued and no writer on it: its turn comes
                queued = self._queues[project_id] = deque()
                self._turns.append(project_id)
                self._cond.notify()
            queued.append(pending)
        return pending

    def close(self) -> None:
        """Record what is queued, then stop (closing the writers' database connections)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(30)

    def _loop(self) -> None:
        from django.db import close_old_connections, connections

        while True:
            with self._cond:
                while not self._turns and not self._closing:
                    self._cond.wait()
                if not self._turns:  # closing, nothing waiting (a busy writer ends its own)
                    break
                project_id = self._turns.popleft()
                queued = self._queues[project_id]
                # a bounded turn while another project waits; alone, one write for all
                size = min(self.turn_calls, len(queued)) if self._turns else len(queued)
                turn = [queued.popleft() for _ in range(size)]
            close_old_connections()
            self._write(turn)
            with self._cond:
                if queued:  # more of this project's calls came: behind the others' turns
                    self._turns.append(project_id)
                    self._cond.notify()
                else:
                    del self._queues[project_id]
        connections.close_all()

    def _write(self, group: list[Pending]) -> None:
        began = time.perf_counter()
        for pending in group:
            pending.began, pending.group = began, len(group)
        with self._cond:
            self.writes += 1
        try:
            store_services.spans_ingest(project=group[0].attribution.project,
                                        spans=[s for p in group for s in p.spans])
        except Exception:
            if len(group) > 1:  # find the culprit: each call on its own
                for pending in group:
                    self._write([pending])
                return
            group[0].error = sys.exc_info()[1]
        for pending in group:
            pending.done.set()
            if pending.on_done is not None:
                try:
                    pending.on_done(pending)
                except Exception:  # e.g. the caller's event loop closed: nobody waits
                    log.warning("a recorded call's callback failed", exc_info=True)


@dataclass(eq=False)
class Pending:
    """A call's spans on their way to the store."""

    attribution: Attribution
    spans: list[dict[str, Any]]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    on_done: Callable[[Pending], None] | None = None
    # perf_counter times (the gateway's Server-Timing): queued, its write began; and how many
    # calls that write stored
    queued: float = field(default_factory=time.perf_counter)
    began: float = 0.0
    group: int = 0


def _span(attribution: Attribution, call: Call, index: int, choice: Sequence_) -> dict[str, Any]:
    if call.idempotency_key:
        trace_id, span_id = _keyed_ids(attribution.attempt_id, call.idempotency_key, index)
    else:
        trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    request = call.request
    out = call.outputs.get(choice.index) or Output(choice.text, None, choice.finish_reason)
    attributes: dict[str, Any] = {
        "gen_ai.system": "lightning",
        "gen_ai.operation.name": "chat" if call.kind == "chat" else "text_completion",
        "gen_ai.request.model": request.get("model"),
        "gen_ai.response.model": call.model,
        "gen_ai.response.id": call.response_id if index == 0 else f"{call.response_id}-{index}",
        c.LLM_FINISH: out.finish_reason,
        "gen_ai.usage.prompt_tokens": len(call.prompt_ids),
        "gen_ai.usage.completion_tokens": len(choice.token_ids),
        c.LLM_PROMPT_IDS: list(call.prompt_ids),
        c.LLM_RESPONSE_IDS: list(choice.token_ids),
        c.LLM_LOGPROBS: list(choice.logprobs),
        c.LLM_LOGPROBS_OF: choice.logprobs_of or None,
        c.LLM_TEMPERATURE: choice.params.temperature,
        c.LLM_TOP_P: choice.params.top_p,
        c.LLM_VERSION: call.version,
        "lightning.llm.latency_ms": round((call.finished - call.started) * 1000, 3),
        "lightning.llm.choice_index": index,
        **({c.LLM_REQUEST_SHA256: call.request_sha256} if call.request_sha256 else {}),
        "logprobs.content": json.dumps([
            {"token": call.token_text(t) if call.token_text else str(t), "logprob": lp,
             "top_logprobs": [{"token": call.token_text(a) if call.token_text else str(a),
                               "logprob": v} for a, v in top]}
            for t, lp, top in zip(choice.token_ids, choice.logprobs, choice.top, strict=True)
        ]),
    }
    for name in ("temperature", "top_p", "max_tokens", "seed", "n"):
        if request.get(name) is not None:
            attributes[f"gen_ai.request.{name}"] = request[name]
    if call.kind == "chat":
        for i, message in enumerate(request.get("messages") or []):
            attributes[f"gen_ai.prompt.{i}.role"] = message.get("role")
            content = message.get("content")
            attributes[f"gen_ai.prompt.{i}.content"] = (
                content if isinstance(content, str) else json.dumps(content))
    else:
        attributes["gen_ai.prompt.0.role"] = "user"
        attributes["gen_ai.prompt.0.content"] = request.get("prompt")
    attributes["gen_ai.completion.0.role"] = "assistant"
    attributes["gen_ai.completion.0.content"] = out.content or ""
    attributes["gen_ai.completion.0.finish_reason"] = out.finish_reason
    _tool_attributes(attributes, request, out)
    if call.retokenized is not None:
        attributes[c.LLM_RETOKENIZED] = call.retokenized
    return {
        "rollout_id": attribution.rollout_id, "attempt_id": attribution.attempt_id,
        "sequence_id": None, "trace_id": trace_id, "span_id": span_id, "parent_id": None,
        "name": c.LLM_CALL_SPAN if call.kind == "chat" else c.LLM_COMPLETION_SPAN,
        "status": {"status_code": "OK", "description": None},
        "attributes": attributes, "events": [], "links": [],
        "start_time": call.started, "end_time": call.finished,
        "context": {"trace_id": trace_id, "span_id": span_id, "is_remote": False,
                    "trace_state": {}},
        "resource": {"attributes": {"service.name": "lightning.gateway"}, "schema_url": ""},
    }



def _tool_attributes(attributes: dict[str, Any], request: dict[str, Any], out: Output) -> None:
    """The tools offered, the messages' calls and results, and the calls returned (OpenLLMetry's
    `gen_ai.completion.0.tool_calls.{k}.*` names)."""
    if isinstance(request.get("tools"), list):
        attributes["gen_ai.request.tools"] = json.dumps(
            [t["function"]["name"] for t in request["tools"]])
    choice = request.get("tool_choice")
    if choice is not None:
        attributes["gen_ai.request.tool_choice"] = (
            choice if isinstance(choice, str) else json.dumps(choice))
    for i, message in enumerate(request.get("messages") or []):
        if message.get("tool_calls"):
            attributes[f"gen_ai.prompt.{i}.tool_calls"] = json.dumps(message["tool_calls"])
        if message.get("tool_call_id"):
            attributes[f"gen_ai.prompt.{i}.tool_call_id"] = message["tool_call_id"]
    for k, tool_call in enumerate(out.tool_calls or []):
        prefix = f"gen_ai.completion.0.tool_calls.{k}"
        attributes[f"{prefix}.id"] = tool_call.get("id")
        attributes[f"{prefix}.name"] = (tool_call.get("function") or {}).get("name")
        attributes[f"{prefix}.arguments"] = (tool_call.get("function") or {}).get("arguments")
