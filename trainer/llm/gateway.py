"""The model gateway: an OpenAI-compatible HTTP API (Starlette) over local engines or an
upstream server, recording every attributed call as a span of its attempt.

Routes, each also under `/rollout/{rollout_id}/attempt/{attempt_id}` (AGL's ProxyLLM):
`POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`; plus `GET /health`,
and with `runtime_lora` vLLM's `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter`
(runtime_lora.py). In upstream mode, LoRA versions are loaded into the upstream through those
same endpoints and each call routed to its pinned version (upstream_lora.py).
Authentication: `Authorization: Bearer KEY` with a project API key (the OpenAI client's
`api_key`), or an attempt token (store/tokens.py) for that attempt's own calls.
Status codes: 401 bad key; 404 unknown model, or rollout/attempt not in the key's project
(nothing recorded); 409 the attempt already ended; 400 malformed body or a prompt beyond the
model's context (the message names the limit); 502 the upstream failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.conf import settings
from django.db import close_old_connections
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from core.metrics import process_metrics
from store.api.auth import authenticate_key_lean, cached_key_lean
from store.errors import NotFound
from store.models import Project, ResourceVersion
from store.services import KeyNotLive, LiveKey, require_key_live
from store.tokens import attempt_token_project
from trainer.checkpoints import CheckpointError
from trainer.llm import calls
from trainer.llm import tools as llm_tools
from trainer.llm.batcher import Batcher
from trainer.llm.engine import Engine, PromptTooLong, Sequence_
from trainer.llm.metrics import record_completion, record_turn
from trainer.llm.openai_api import BadRequest, Parsed, chunk, parse, response, usage
from trainer.llm.registry import Registry, Space, UnknownModel
from trainer.llm.retries import RETRY_HEADER, Retries
from trainer.llm.turns import Turns

log = logging.getLogger(__name__)
# Threads that do a call's database work (authentication of a key not cached, attribution;
# each with its connection; none waits for the engine or the store; spans are written by the
# recorder's writers, calls.Recorder): the gateway's share of Postgres connections (README
# "Deploy", the budget).
DB_THREADS = 64


class Gateway:
    def __init__(self, *, registry: Registry | None = None, batcher: Batcher | None = None,
                 upstream: Any = None, poll_seconds: float = 1.0,
                 max_body_bytes: int = 4 * 2**20, body_timeout: float = 30.0,
                 max_tokens: int | None = 4096, max_sequences_per_project: int = 256,
                 threads: int = DB_THREADS, runtime_lora: bool = False,
                 upstream_keep: int = 2, record_writers: int = 2,
                 record_turn_calls: int = 16) -> None:
        self.registry = registry or Registry()
        # Limits a request meets before any work is done for it (README "Model gateway").
        self.max_body_bytes, self.body_timeout = max_body_bytes, body_timeout
        self.max_tokens = max_tokens
        # Admission: sequences a project may have in flight (queued or decoding); past it, 429.
        self.max_sequences_per_project = max_sequences_per_project
        self._in_flight: dict[int, int] = {}
        self._admit_lock = threading.Lock()
        self.batcher = batcher or Batcher()
        self.upstream = upstream  # trainer.llm.upstream.Upstream, or None: local engines
        self.runtime_lora = runtime_lora  # serve vLLM's runtime LoRA endpoints
        self.upstream_loras = None  # LoRA versions loaded into the upstream (upstream_lora.py)
        if upstream is not None:
            from trainer.llm.upstream_lora import UpstreamLoRAs

            self.upstream_loras = UpstreamLoRAs(upstream, keep=upstream_keep)
        self.recorder = calls.Recorder(writers=record_writers, turn_calls=record_turn_calls)
        self.turns = Turns()  # each attempt's last call: does the next one extend it?
        self.retries = Retries()  # each attempt's last keyless call: is the next its retry?
        self.poll_seconds = poll_seconds
        self._watched: dict[tuple[int, str], str] = {}
        self._failures: dict[Space, int] = {}  # failed preloads in a row, per space (backoff)
        self._retry_at: dict[Space, float] = {}
        self._watch_lock = threading.Lock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        # Database work runs on these threads (each keeps its connection); `close` closes them.
        self._threads = threads
        self._db = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="llm-gateway")
        self._mailbox_: _Mailbox | None = None  # wakes calls (engine and recorder threads)

    def _mailbox(self) -> _Mailbox:
        """The running event loop's mailbox (a new loop, a new one: tests restart servers)."""
        loop = asyncio.get_running_loop()
        mailbox = self._mailbox_
        if mailbox is None or mailbox.loop is not loop:
            mailbox = self._mailbox_ = _Mailbox(loop)
        return mailbox

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._db, fn, *args)

    def close(self) -> None:
        """Close the database connections of the gateway's threads (then stop using it)."""
        from django.db import connections

        self.stop_polling()
        barrier = threading.Barrier(self._threads)

        def close_one() -> None:
            try:
                barrier.wait(5)  # one task per thread: each waits until all threads took one
            except threading.BrokenBarrierError:
                pass
            connections.close_all()

        for future in [self._db.submit(close_one) for _ in range(self._threads)]:
            future.result()
        self._db.shutdown(wait=True)
        self.recorder.close()
        if hasattr(self.batcher, "close"):  # the engine process (engine_client.py)
            self.batcher.close()

    # --- the app ------------------------------------------------------------------------------
    def app(self) -> Starlette:
        routes = []
        for prefix in ("", "/rollout/{rollout_id}/attempt/{attempt_id}"):
            routes += [
                Route(prefix + "/v1/chat/completions", self._chat, methods=["POST"]),
                Route(prefix + "/v1/completions", self._completions, methods=["POST"]),
                Route(prefix + "/v1/models", self._models, methods=["GET"]),
            ]
        if self.runtime_lora:
            from trainer.llm.runtime_lora import RuntimeLoRA

            routes += RuntimeLoRA(self).routes()
        routes.append(Route("/health", self._health, methods=["GET"]))
        routes.append(Route("/metrics", self._metrics, methods=["GET"]))
        app = Starlette(routes=routes, lifespan=self._lifespan)
        app.state.gateway = self
        return app

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette):
        self.start_polling()
        try:
            yield
        finally:
            self.stop_polling()

    async def _health(self, request: Request) -> Response:
        # Unauthenticated: it names nothing (GET /v1/models lists what a key may call).
        return JSONResponse({"status": "ok"})

    async def _metrics(self, request: Request) -> Response:
        """Prometheus text (lightning_gateway_* among them), for `Bearer $METRICS_TOKEN`."""
        token = settings.METRICS_TOKEN
        header = request.headers.get("authorization", "")
        if not token or not hmac.compare_digest(header.encode(), f"Bearer {token}".encode()):
            return Response("metrics need 'Authorization: Bearer $METRICS_TOKEN'\n",
                            status_code=401, media_type="text/plain")
        return Response(process_metrics(), media_type=CONTENT_TYPE_LATEST)

    async def _models(self, request: Request) -> Response:
        try:
            project = await self._in_thread(self._authorize, request,
                                            request.path_params.get("rollout_id"),
                                            request.path_params.get("attempt_id"))
        except BadRequest as exc:
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        now = int(time.time())
        names = (self.registry.names(project.pk) if self.upstream is None
                 else [self.upstream.model])
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": now, "owned_by": "lightning"}
            for name in names]})

    async def _chat(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def _completions(self, request: Request) -> Response:
        return await self._complete(request, "completion")

    async def _complete(self, request: Request, kind: str) -> Response:
        started, clock = time.time(), time.perf_counter()
        marks = [clock]  # after each phase (Server-Timing)
        admitted: tuple[int | None, int] = (None, 0)
        try:
            # The key first: nothing of an unauthenticated body is read or parsed. A key this
            # process authenticated within the minute needs no database here: its liveness is
            # checked by the call's first statement (`_prepare`).
            lean = cached_key_lean(_bearer(request))
            if lean is None:
                project = await self._in_thread(self._authorize, request,
                                                *_attributed_ids(request))
            else:
                project = lean.project
            live_key = lean.live_check if lean is not None else None
            marks.append(time.perf_counter())
            body = _json(await self._body(request))
            parsed = parse(body, kind, max_tokens_cap=self.max_tokens)
            self._admit(project.pk, parsed.n)
            admitted = (project.pk, parsed.n)
            marks.append(time.perf_counter())
            if parsed.stream:
                prepared = await self._in_thread(self._prepare, request, parsed, project,
                                                 live_key)
                chunks = self._stream(prepared, started, admitted)
                admitted = (None, 0)  # the stream's work releases it when it ends
                return StreamingResponse(chunks, media_type="text/event-stream")
            prepared = await self._in_thread(self._prepare, request, parsed, project, live_key)
            marks.append(time.perf_counter())
            await self._generate(prepared)
            marks.append(time.perf_counter())
            await self._record(prepared, started)
            marks.append(time.perf_counter())
        except BadRequest as exc:
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        finally:
            self._release(*admitted)
        body = response(parsed, rid=prepared.rid, model=prepared.model_name,
                        prompt_ids=prepared.prompt_ids, choices=prepared.choices,
                        text_of=prepared.text_of,
                        outputs={s.index: prepared.output(s) for s in prepared.choices})
        marks.append(time.perf_counter())
        return JSONResponse(body, headers={"Server-Timing": _server_timing(marks, prepared)})

    async def _body(self, request: Request) -> bytes:
        """The body, at most max_body_bytes, within body_timeout (else 413 / 408)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                async for part in request.stream():
                    size += len(part)
                    if size > self.max_body_bytes:
                        raise _too_large(self.max_body_bytes)
                    chunks.append(part)
        except TimeoutError:
            raise BadRequest(f"the request body did not arrive within {self.body_timeout:g} s",
                             status=408, code="request_timeout") from None
        return b"".join(chunks)

    # --- the steps of a call (in worker threads: they touch the database) --------------------
    def _authorize(self, request: Request, rollout_id: str | None = None,
                   attempt_id: str | None = None) -> Project:
        """The caller's project, the key read and compared in the database (and kept in the
        lean cache for the calls that follow, `_complete`)."""
        close_old_connections()
        raw = _bearer(request)
        if not raw:
            raise BadRequest("missing API key: send 'Authorization: Bearer KEY'", status=401,
                             code="invalid_api_key", kind="authentication_error")
        if rollout_id and attempt_id:
            project_id = attempt_token_project(raw, rollout_id=rollout_id, attempt_id=attempt_id)
            if project_id is not None:
                project = Project.objects.filter(pk=project_id).first()
                if project is not None:
                    return project
        key = authenticate_key_lean(raw, cached=False)
        if key is None:
            raise BadRequest("invalid or revoked API key", status=401, code="invalid_api_key",
                             kind="authentication_error")
        return key.project

    def _prepare(self, request: Request, parsed: Parsed, project: Project | None = None,
                 live_key: LiveKey | None = None) -> _Prepared:
        """`live_key`: the project is a cached key's (`_complete`), whose liveness this
        checks in its first statement; a key found not live (revoked, or its role changed)
        is authenticated in full here, as a key not cached is."""
        rollout_id, attempt_id = _attributed_ids(request)
        if bool(rollout_id) != bool(attempt_id):
            raise BadRequest("attribution needs both a rollout id and an attempt id")
        if live_key is not None:
            close_old_connections()
        if project is None:
            project = self._authorize(request, rollout_id, attempt_id)
        attribution = None
        try:
            if rollout_id:
                attribution = self._attribute(project, rollout_id, attempt_id, live_key)
            elif live_key is not None:
                require_key_live(live_key)
        except KeyNotLive:
            project = self._authorize(request, rollout_id, attempt_id)
            attribution = (self._attribute(project, rollout_id, attempt_id, None)
                           if rollout_id else None)
        return self._prepare_attributed(request, parsed, project, attribution)

    @staticmethod
    def _attribute(project: Project, rollout_id: str, attempt_id: str,
                   live_key: LiveKey | None) -> calls.Attribution:
        try:
            return calls.attribute(project=project, rollout_id=rollout_id,
                                   attempt_id=attempt_id, live_key=live_key)
        except NotFound as exc:
            raise BadRequest(str(exc), status=404, code="not_found") from None
        except calls.AttemptFinished as exc:
            raise BadRequest(str(exc), status=409, code="attempt_finished") from None

    def _prepare_attributed(self, request: Request, parsed: Parsed, project: Project,
                            attribution: calls.Attribution | None) -> _Prepared:
        key = request.headers.get("idempotency-key") or request.headers.get("x-request-id")
        digest, fresh = None, False
        if attribution is not None:
            digest = calls.request_sha256(parsed.body)
            if not key:  # a client's retry of a keyless call is that call (trainer/llm/retries)
                key, retry = self.retries.key_for(attribution, digest,
                                                  request.headers.get(RETRY_HEADER))
                fresh = not retry
        prepared = _Prepared(parsed, project, attribution, key)
        if key and attribution is not None:
            prepared.request_sha256 = digest
            try:
                if not fresh:  # a key of our own making, new: nothing recorded under it yet
                    calls.check_key(attribution, key, digest)
            except calls.KeyReused as exc:
                raise BadRequest(str(exc), status=422, code="idempotency_key_reused") from None
        if self.upstream is not None:
            prepared.model_name = parsed.model
            self._upstream_lora(prepared)
            return prepared
        engine = self._engine(parsed, project, attribution)
        prepared.engine, prepared.model_name = engine, engine.name
        previous = (self.turns.previous(attribution, key) if attribution is not None
                    else None)  # the attempt's last call: its ids are kept as generated
        prepared.prompt_ids = _prompt_ids(engine, parsed, previous)
        try:
            engine.check_prompt(prepared.prompt_ids)
        except PromptTooLong as exc:
            raise BadRequest(str(exc), "messages" if parsed.kind == "chat" else "prompt",
                             code="context_length_exceeded") from None
        prepared.choices = parsed.sequences(prepared.prompt_ids)
        prepared.text_of = lambda t: engine.tokenizer.decode([t])
        return prepared

    def _engine(self, parsed: Parsed, project: Project,
                attribution: calls.Attribution | None) -> Engine:
        try:
            if attribution is not None and attribution.llm is not None:
                try:
                    calls.check_checkpoint(attribution.llm, project.pk)
                except calls.NotYourCheckpoint as exc:
                    raise BadRequest(f"the rollout's llm resource cannot be served: {exc}",
                                     "model", status=403, code="checkpoint_not_allowed",
                                     kind="permission_error") from None
                self.watch(project.pk, attribution.resources_id, str(attribution.llm["model"]))
                return self.registry.for_resource(attribution.llm, project_id=project.pk,
                                                  resources_id=attribution.resources_id or "")
            return self.registry.by_name(parsed.model, project_id=project.pk)
        except CheckpointError as exc:  # the published checkpoint is broken: the tenant's to fix
            raise BadRequest(f"the rollout's checkpoint cannot be loaded: {exc}", "model",
                             status=422, code="checkpoint_unavailable") from None
        except UnknownModel:
            raise BadRequest(f"the model '{parsed.model}' does not exist", "model", status=404,
                             code="model_not_found") from None

    def _upstream_lora(self, prepared: _Prepared) -> None:
        """A rollout pinned to a LoRA version: that version's adapter in the upstream (loaded
        there if need be), held by the call until it is generated."""
        from trainer.llm import upstream_lora

        attribution = prepared.attribution
        if attribution is None or attribution.llm is None or \
                not upstream_lora.is_lora(attribution.llm):
            return
        try:
            calls.check_checkpoint(attribution.llm, prepared.project.pk)
        except calls.NotYourCheckpoint as exc:
            raise BadRequest(f"the rollout's llm resource cannot be served: {exc}", "model",
                             status=403, code="checkpoint_not_allowed",
                             kind="permission_error") from None
        resources_id = attribution.resources_id or ""
        self.watch(prepared.project.pk, resources_id, str(attribution.llm["model"]))
        try:
            prepared.lease = self.upstream_loras.acquire(prepared.project.pk, resources_id,
                                                         attribution.llm)
        except CheckpointError as exc:
            raise BadRequest(f"the rollout's checkpoint cannot be loaded: {exc}", "model",
                             status=422, code="checkpoint_unavailable") from None

    async def _generate(self, prepared: _Prepared) -> None:
        """The call's sequences decoded. No thread waits for the engine: the batcher wakes
        this coroutine (one tenant's long generations cannot hold every worker thread, and
        with them another tenant's authentication and recording)."""
        began = time.perf_counter()
        if self.upstream is not None:
            try:
                await self._in_thread(self.upstream.complete, prepared)
            finally:
                if prepared.lease is not None:
                    self.upstream_loras.release(prepared.lease)
            prepared.engine_seconds = time.perf_counter() - began
            return
        mailbox = self._mailbox()
        finished = mailbox.loop.create_future()

        def wake(job) -> None:  # on the batcher's thread
            mailbox.post(_settle, finished, None)

        job = self.batcher.submit(prepared.engine, prepared.choices, tenant=prepared.project.pk,
                                  on_done=wake)
        await finished
        prepared.engine_seconds = time.perf_counter() - began
        prepared.job = job
        if job.error is not None:
            raise job.error

    async def _generate_and_record(self, prepared: _Prepared, started: float,
                                   admitted: tuple[int, int]) -> None:
        try:
            await self._generate(prepared)
            await self._record(prepared, started)
        finally:
            self._release(*admitted)

    def _admit(self, project_id: int, sequences: int) -> None:
        """Per-project admission: past max_sequences_per_project in flight, 429 (the OpenAI
        client retries it after Retry-After)."""
        with self._admit_lock:
            held = self._in_flight.get(project_id, 0)
            if held and held + sequences > self.max_sequences_per_project:
                raise BadRequest(f"this project has {held} sequences in flight (at most "
                                 f"{self.max_sequences_per_project}); retry shortly",
                                 status=429, code="rate_limit_exceeded",
                                 kind="rate_limit_error", headers={"Retry-After": "1"})
            self._in_flight[project_id] = held + sequences

    def _release(self, project_id: int | None, sequences: int) -> None:
        if project_id is None:
            return
        with self._admit_lock:
            left = self._in_flight.get(project_id, 0) - sequences
            if left > 0:
                self._in_flight[project_id] = left
            else:
                self._in_flight.pop(project_id, None)

    async def _record(self, prepared: _Prepared, started: float) -> None:
        """The call's spans stored before it is answered: built here, written with its
        project's calls that finish meanwhile by one of the recorder's writers (group commit,
        projects in turn), which wakes this coroutine (no thread waits for the store)."""
        record_completion(model=prepared.model_name, prompt_tokens=len(prepared.prompt_ids),
                          completion_tokens=sum(len(s.token_ids) for s in prepared.choices),
                          seconds=time.time() - started)
        if prepared.attribution is None:
            return
        outputs = {s.index: prepared.output(s) for s in prepared.choices}
        said = {} if self.upstream is not None else {  # what its calls were as generated
            k: v for s in prepared.choices
            for k, v in llm_tools.said(outputs[s.index], s.text).items()}
        chained = self.turns.follow(prepared.attribution, prepared.prompt_ids,
                                    [s.token_ids for s in prepared.choices], prepared.key, said)
        if chained is not None:
            record_turn(model=prepared.model_name, mismatch=not chained)
        call = calls.Call(
            kind=prepared.parsed.kind, model=prepared.model_name, version=prepared.version,
            request=prepared.parsed.body, prompt_ids=prepared.prompt_ids,
            choices=prepared.choices, started=started, finished=time.time(),
            response_id=prepared.rid, idempotency_key=prepared.key, token_text=prepared.text_of,
            request_sha256=prepared.request_sha256, outputs=outputs,
            retokenized=None if chained is None else not chained)
        mailbox = self._mailbox()
        stored = mailbox.loop.create_future()

        def wake(pending: calls.Pending) -> None:  # on a recorder's writer
            mailbox.post(_settle, stored, pending.error)

        prepared.pending = self.recorder.submit(prepared.attribution, call, on_done=wake)
        await asyncio.wait_for(stored, calls.RECORD_TIMEOUT)

    def _stream(self, prepared: _Prepared, started: float, admitted: tuple[int, int]):
        """Start the call's work now (whether or not the response is ever iterated: it is
        recorded and its admission released in any case) and return the chunks to send."""
        mailbox = self._mailbox()
        events: asyncio.Queue = asyncio.Queue()
        parsed, created = prepared.parsed, int(started)
        holdback = max((len(s) for s in parsed.params.stop), default=1) - 1
        offered = parsed.tools is not None and parsed.tools.offered
        sent = [0] * len(prepared.choices)
        finals: list[dict[str, Any]] = []  # appended by the decode thread, read after it

        def on_token(seq: Sequence_, token: int, logprob: float, top: list) -> None:
            end = len(seq.text) if seq.done else max(sent[seq.index], len(seq.text) - holdback)
            out = prepared.output(seq) if seq.done else None
            if out is not None and out.tool_calls:  # the calls go out whole, at the end
                end = len(out.content or "")
            elif offered and not seq.done:  # a call may be starting: held until it ends
                end = max(sent[seq.index], llm_tools.safe_end(seq.text, end))
            text, sent[seq.index] = seq.text[sent[seq.index]:end], end
            lp = None
            if parsed.logprobs:
                entry = {"token": prepared.text_of(token), "logprob": logprob,
                         "top_logprobs": [{"token": prepared.text_of(a), "logprob": v}
                                          for a, v in top]}
                lp = {"content": [entry]} if parsed.kind == "chat" else {
                    "tokens": [entry["token"]], "token_logprobs": [logprob]}
            event = chunk(parsed, rid=prepared.rid, model=prepared.model_name, created=created,
                          index=seq.index, text=text,
                          finish_reason=out.finish_reason if out is not None else None,
                          token_ids=[token], logprobs=lp,
                          tool_calls=out.tool_calls if out is not None else None)
            if seq.done:  # its last chunk goes out once the call is recorded
                finals.append(event)
            else:
                mailbox.post(events.put_nowait, event)

        for seq in prepared.choices:
            seq.on_token = on_token
        # Generation and recording in one piece of work that does not depend on this stream:
        # a client that leaves (even at the last token) does not stop its call being recorded.
        work = asyncio.ensure_future(self._generate_and_record(prepared, started, admitted))
        return self._chunks(prepared, created, events, finals, work)

    async def _chunks(self, prepared: _Prepared, created: int, events: asyncio.Queue,
                      finals: list[dict[str, Any]], work: asyncio.Future):
        parsed = prepared.parsed
        if parsed.kind == "chat":
            for seq in prepared.choices:
                yield _sse(chunk(parsed, rid=prepared.rid, model=prepared.model_name,
                                 created=created, index=seq.index, text="", finish_reason=None,
                                 role=True))
        while True:
            getter = asyncio.ensure_future(events.get())
            done, _ = await asyncio.wait({getter, work}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:  # with every chunk already waiting: one write, not one each
                yield _sse(getter.result()) + _waiting(events)
                continue
            getter.cancel()
            break
        rest = _waiting(events)
        if rest:
            yield rest
        try:
            work.result()
        except Exception as exc:  # the stream already started: report in-band
            log.exception("streamed call failed")
            yield _sse({"error": {"message": str(exc), "type": "server_error"}})
            return
        for seq in prepared.choices:
            if seq.on_token is None:  # an upstream server's answer: forwarded whole
                out = prepared.output(seq)
                finals.append(chunk(parsed, rid=prepared.rid, model=prepared.model_name,
                                    created=created, index=seq.index, text=out.content,
                                    finish_reason=out.finish_reason, role=True,
                                    token_ids=list(seq.token_ids), tool_calls=out.tool_calls))
        for event in sorted(finals, key=lambda e: e["choices"][0]["index"]):
            yield _sse(event)
        if parsed.include_usage:
            yield _sse({"id": prepared.rid, "object": "chat.completion.chunk", "created": created,
                        "model": prepared.model_name, "choices": [],
                        "usage": usage(prepared.prompt_ids, prepared.choices)})
        yield "data: [DONE]\n\n"

    # --- hot reload: follow the resources of the models served --------------------------------
    def watch(self, project_id: int, resources_id: str | None, model: str) -> None:
        if resources_id:
            with self._watch_lock:
                self._watched[(project_id, resources_id)] = model

    def start_polling(self) -> None:
        if self._poller is None:
            self._poller = threading.Thread(target=self._poll_loop, name="llm-gateway-poller",
                                            daemon=True)
            self._poller.start()

    def stop_polling(self) -> None:
        self._stop.set()

    def poll_once(self) -> int:
        """Load the newest published version of every watched model; returns how many."""
        loaded = 0
        with self._watch_lock:
            watched = list(self._watched.items())
        for (project_id, resources_id), model in watched:
            row = (ResourceVersion.objects.filter(
                resource_set__project_id=project_id, resource_set__resources_id=resources_id)
                .order_by("-version").first())
            llm = calls.llm_resource(row.resources) if row is not None else None
            if llm is None or str(llm.get("model")) != model:
                continue
            if self.upstream_loras is not None:
                loaded += self._preload_upstream(project_id, resources_id, llm)
                continue
            space = Space(project_id, resources_id, model)
            if self._retry_at.get(space, 0) > time.monotonic():
                continue  # backing off after a failed load
            version, newest = int(llm.get("version") or 0), self.registry.loaded_versions(space)
            if not newest or version > max(newest):
                try:
                    calls.check_checkpoint(llm, project_id)
                except calls.NotYourCheckpoint as exc:
                    with self._watch_lock:  # said once, then no longer followed
                        self._watched.pop((project_id, resources_id), None)
                    log.warning("model %s: not loading version %s: %s", space, version, exc)
                    continue
                try:
                    self.registry.for_resource(llm, project_id=project_id,
                                               resources_id=resources_id)
                except CheckpointError as exc:  # said once; a later call says it again
                    with self._watch_lock:
                        self._watched.pop((project_id, resources_id), None)
                    log.warning("model %s: version %s does not load (%s); no longer preloaded",
                                space, version, exc)
                    continue
                except Exception as exc:  # the storage is away: this entry again, later
                    failures = self._failures.get(space, 0) + 1
                    self._failures[space] = failures
                    self._retry_at[space] = time.monotonic() + min(2 ** failures, 300)
                    log.warning("model %s: loading version %s failed (%s); retrying in %d s",
                                space, version, exc, min(2 ** failures, 300))
                    continue
                self._failures.pop(space, None)
                loaded += 1
        return loaded

    def _preload_upstream(self, project_id: int, resources_id: str,
                          llm: dict[str, Any]) -> int:
        """A newly published LoRA version loaded into the upstream before its first call."""
        from trainer.llm import upstream_lora

        version = int(llm.get("version") or 0)
        newest = self.upstream_loras.loaded(project_id, resources_id)
        if not upstream_lora.is_lora(llm) or (newest and version <= max(newest)):
            return 0
        try:
            calls.check_checkpoint(llm, project_id)
            self.upstream_loras.release(self.upstream_loras.acquire(project_id, resources_id,
                                                                    llm))
        except (calls.NotYourCheckpoint, CheckpointError) as exc:
            with self._watch_lock:  # said once, then no longer followed
                self._watched.pop((project_id, resources_id), None)
            log.warning("model %s/%s: not loading version %s into the upstream: %s",
                        project_id, resources_id, version, exc)
            return 0
        except BadRequest:  # the upstream refused it: said in the log; retried with backoff
            return 0
        return 1

    def _poll_loop(self) -> None:
        from django.db import connections

        try:
            while not self._stop.wait(self.poll_seconds):
                try:
                    self.poll_once()
                except Exception:  # the store is away: try at the next tick
                    log.exception("the gateway's poll for new checkpoints failed")
        finally:
            connections.close_all()


class _Mailbox:
    """Work that other threads (the engine's reader or batcher, the recorder) hand to the
    event loop: what is posted while a run is pending joins it, so a decode step that ends
    16 calls, or streams 64 tokens, wakes the loop once, not once each."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[tuple[Any, tuple]] = []
        self._lock = threading.Lock()

    def post(self, fn, *args) -> None:
        with self._lock:
            self._items.append((fn, args))
            if len(self._items) > 1:  # a run is pending: it takes this too
                return
        self.loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for fn, args in items:
            try:
                fn(*args)
            except Exception:  # one caller's failure is not the others'
                log.exception("the gateway's event loop failed to run %s", fn)


class _Prepared:
    """One call on its way: who asked, what for, and (once generated) what it got."""

    def __init__(self, parsed: Parsed, project: Project, attribution: calls.Attribution | None,
                 key: str | None) -> None:
        self.parsed, self.project, self.attribution, self.key = parsed, project, attribution, key
        self.rid = calls.response_id(parsed.kind, key)
        self.engine: Engine | None = None
        self.model_name = parsed.model
        self.prompt_ids: list[int] = []
        self.choices: list[Sequence_] = []
        self.text_of = str
        self.engine_seconds = 0.0  # in the engine's queue and decoding (or the upstream)
        self.request_sha256: str | None = None
        self.outputs: dict[int, llm_tools.Output] = {}  # an upstream's answers, as it gave them
        self.lease = None  # upstream mode: the LoRA adapter serving it (upstream_lora.Lease)
        self.job = None  # the engine's request, once generated (its times: Server-Timing)
        self.pending: calls.Pending | None = None  # its spans on their way to the store

    def output(self, seq: Sequence_) -> llm_tools.Output:
        """The choice as the client gets it: tool calls parsed from its text (the same each
        time it is asked: the calls' ids derive from the response id), or the upstream's."""
        if seq.index in self.outputs:
            return self.outputs[seq.index]
        return llm_tools.parse(seq.text, seq.finish_reason, self.parsed.tools,
                               f"{self.rid}:{seq.index}")

    @property
    def version(self) -> int:
        # Upstream: the LoRA version that served it, else 0 (the server names no version).
        if self.engine is not None:
            return self.engine.version
        return self.lease.version if self.lease is not None else 0


def _prompt_ids(engine: Engine, parsed: Parsed,
                previous: llm_tools.Previous | None = None) -> list[int]:
    body = parsed.body
    field = "messages" if parsed.kind == "chat" else "prompt"
    _check_prompt_size(engine, parsed)
    try:
        if parsed.kind == "chat":
            return llm_tools.render(engine.tokenizer, body["messages"], parsed.tools, previous)
        prompt = body["prompt"]
        if isinstance(prompt, list):
            vocab = _vocab_size(engine)
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise BadRequest(f"token id {bad} is outside this model's vocabulary "
                                 f"(0..{vocab - 1})", "prompt")
            return [int(t) for t in prompt]
        return [int(t) for t in engine.tokenizer(prompt)["input_ids"]]
    except ValueError as exc:
        raise BadRequest(str(exc), field) from None


def _check_prompt_size(engine: Engine, parsed: Parsed) -> None:
    """A prompt too long for the context is refused before tokenizing it: no token of this
    vocabulary spans more than `longest` characters, so a text of more than
    context x longest characters cannot fit."""
    body = parsed.body
    if parsed.kind == "chat":
        chars = sum(len(m["content"]) if isinstance(m.get("content"), str) else
                    sum(len(p["text"]) for p in m.get("content") or []) for m in body["messages"])
        chars += llm_tools.extra_chars(body)
    elif isinstance(body["prompt"], str):
        chars = len(body["prompt"])
    else:
        return
    at_least = -(-chars // _longest_token(engine))  # tokens, whatever the text
    if at_least >= engine.context:
        raise BadRequest(f"the prompt is at least {at_least} tokens ({chars} characters); this "
                         f"model's context is {engine.context} tokens (prompt plus completion)",
                         "messages" if parsed.kind == "chat" else "prompt",
                         code="context_length_exceeded")


# checkpoint directory -> (vocabulary size, longest token); by path, not id(): an unloaded
# engine's id may be reused by the next one loaded.
_token_facts: dict[str, tuple[int, int]] = {}


def _facts(engine: Engine) -> tuple[int, int]:
    key = engine.path
    if key not in _token_facts:
        # An id must have a row in the model's embedding and a token in the tokenizer.
        size = len(engine.tokenizer)
        size = min(size, engine.vocab_size or size)
        longest = max((len(token) for token in engine.tokenizer.get_vocab()), default=1)
        _token_facts[key] = (size, max(longest, 1))
    return _token_facts[key]


def _vocab_size(engine: Engine) -> int:
    return _facts(engine)[0]


def _longest_token(engine: Engine) -> int:
    return _facts(engine)[1]


# Server-Timing's phases of a call, in order (README "The model gateway": what each is).
_PHASES = ("auth", "parse", "prepare", "engine", "record", "respond")


def _server_timing(marks: list[float], prepared: _Prepared) -> str:
    """What the call spent in each phase (ms), the engine's share split where it is known,
    and `gateway`: the whole call less the engine's (waiting for and in the engine)."""
    parts = {name: (b - a) * 1000 for name, a, b in zip(_PHASES, marks, marks[1:],
                                                           strict=False)}
    job, woken = prepared.job, marks[4] if len(marks) > 4 else marks[-1]
    if job is not None and job.joined:
        received = getattr(job, "received", 0.0)
        decoded = getattr(job, "decoded", 0.0) or job.finished
        if received:  # the engine process: the handoff there, then its queue
            parts["handoff"] = (received - job.submitted) * 1000
            parts["queue"] = (job.joined - received) * 1000
        else:
            parts["queue"] = (job.joined - job.submitted) * 1000
        parts["decode"] = (decoded - job.joined) * 1000
        parts["wake"] = (woken - decoded) * 1000
    pending = prepared.pending
    if pending is not None and pending.began and len(marks) > 5:
        # the recorder's queue (its project's turn), then the group's write and the wakeup
        parts["store_queue"] = (pending.began - pending.queued) * 1000
        parts["store"] = (marks[5] - pending.began) * 1000
        parts["store_group"] = pending.group
    total = (marks[-1] - marks[0]) * 1000
    parts["gateway"] = total - parts.get("engine", 0.0)
    return ", ".join(f"{name};dur={value:.2f}" for name, value in parts.items())


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(None)


def _bearer(request: Request) -> str:
    """The key of `Authorization: Bearer KEY`, or "" when there is none."""
    scheme, _, raw = request.headers.get("authorization", "").partition(" ")
    return raw.strip() if scheme.lower() == "bearer" else ""


def _attributed_ids(request: Request) -> tuple[str | None, str | None]:
    rollout_id = request.path_params.get("rollout_id") or request.headers.get("x-rollout-id")
    attempt_id = request.path_params.get("attempt_id") or request.headers.get("x-attempt-id")
    if "\x00" in (rollout_id or "") + (attempt_id or ""):  # no id holds one (nor can the store)
        raise BadRequest("no such rollout or attempt", status=404, code="not_found")
    return rollout_id, attempt_id


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    except ValueError:
        raise BadRequest("the request body is not valid JSON") from None


def _too_large(limit: int) -> BadRequest:
    return BadRequest(f"the request body is larger than {limit} bytes", status=413,
                      code="request_too_large")


def _waiting(events: asyncio.Queue) -> str:
    """The chunks already queued, as one piece of the stream."""
    parts = []
    while not events.empty():
        parts.append(_sse(events.get_nowait()))
    return "".join(parts)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
