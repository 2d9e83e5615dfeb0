"""vLLM's runtime LoRA endpoints on our gateway, so that a gateway in upstream mode (or anything
written for vLLM) can load adapters into it: `POST /v1/load_lora_adapter` with `{"lora_name",
"lora_path"}` and `POST /v1/unload_lora_adapter` with `{"lora_name"}` (`lora_int_id`, and
anything else, ignored). Served only when LLM_GATEWAY_ALLOW_RUNTIME_LORA_UPDATING is on (vLLM:
VLLM_ALLOW_RUNTIME_LORA_UPDATING); otherwise the routes do not exist (404, as vLLM).

Answers as vLLM's: 200 with the plain-text `Success: LoRA adapter 'NAME' added successfully.`
(`... removed successfully.`); errors in vLLM's shape `{"error": {"message", "type", "param",
"code": <the status>}}`: 400 `InvalidUserInput` (a field missing, the name already loaded),
404 `NotFoundError` (no adapter at that path; unloading a name not loaded), 400
`BadRequestError` (not a LoRA adapter, trained on a base this gateway has not loaded).

Unlike vLLM, ours has tenants: the key must be an algorithm (or admin) key of a project; the
adapter lives in that project's namespace only (registry.py `Space.runtime`: listed and
callable by that project's keys, at most LLM_GATEWAY_MAX_MODELS_PER_PROJECT of them); and the
path must be a checkpoint directory of one of that project's training jobs in the checkpoint
storage (`<storage>/jobs/<id>/step-...`), so that a key cannot make the gateway read weights its
project did not train (a path outside answers exactly as one that does not exist). The adapter
decodes on the shared copy of a base this gateway already serves (`LLM_GATEWAY_MODELS` or an
adapter's) whose sha256 is the one the adapter recorded (lora.py).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from store.api.auth import ALGORITHM_ROLES, authenticate_key
from trainer.llm import adapters, calls, lora, models
from trainer.llm.registry import AlreadyLoaded, Registry, TooManyAdapters

log = logging.getLogger(__name__)


class _Refused(Exception):
    def __init__(self, message: str, kind: str = "BadRequestError", status: int = 400) -> None:
        super().__init__(message)
        self.message, self.kind, self.status = message, kind, status

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind,
                                       "param": None, "code": self.status}},
                            status_code=self.status)


class RuntimeLoRA:
    """The two endpoints over a gateway's registry (the calls themselves go through the
    gateway's usual routes, `model` = the adapter's name)."""

    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway
        self._shas: dict[str, tuple[str, str]] = {}  # engine path -> (sha256, directory)
        self._sha_lock = threading.Lock()

    @property
    def registry(self) -> Registry:
        return self.gateway.registry

    def routes(self) -> list[Route]:
        return [Route("/v1/load_lora_adapter", self._load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self._unload, methods=["POST"])]

    async def _load(self, request: Request) -> Response:
        return await self._handle(request, self.load)

    async def _unload(self, request: Request) -> Response:
        return await self._handle(request, self.unload)

    async def _handle(self, request: Request, action) -> Response:
        try:
            project_id = await self.gateway._in_thread(self._project, request)
            raw = await self.gateway._body(request)
            try:
                body = json.loads(raw)
            except ValueError:
                raise _Refused("the request body is not valid JSON",
                               "InvalidUserInput") from None
            if not isinstance(body, dict):
                raise _Refused("the request body must be a JSON object", "InvalidUserInput")
            message = await self.gateway._in_thread(action, project_id, body)
        except _Refused as exc:
            return exc.response()
        except Exception as exc:  # noqa: BLE001 - the gateway's own refusals (413, 408)
            status = getattr(exc, "status", None)
            if status is None:
                raise
            return _Refused(str(exc), "BadRequestError", status).response()
        return Response(message, media_type="text/plain")

    def _project(self, request: Request) -> int:
        from django.db import close_old_connections

        close_old_connections()
        scheme, _, raw = request.headers.get("authorization", "").partition(" ")
        key = authenticate_key(raw.strip()) if scheme.lower() == "bearer" and raw.strip() \
            else None
        if key is None:
            raise _Refused("invalid or missing API key: send 'Authorization: Bearer KEY'",
                           "AuthenticationError", 401)
        if key.role not in ALGORITHM_ROLES:
            raise _Refused(f"loading LoRA adapters needs an algorithm or admin key; this key "
                           f"is a {key.role} key", "PermissionError", 403)
        return key.project_id

    # --- in a worker thread ----------------------------------------------------------------
    def load(self, project_id: int, body: dict[str, Any]) -> str:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            raise _Refused("Both 'lora_name' and 'lora_path' must be provided.",
                           "InvalidUserInput")
        if name in self.registry.runtime_names(project_id):
            raise _Refused(f"The lora adapter '{name}' has already been loaded.",
                           "InvalidUserInput")
        directory = self._own_checkpoint(project_id, path)
        if not lora.is_adapter(directory):
            raise _Refused(f"{path} is not a LoRA adapter of this system (no {lora.META}: "
                           f"saved by grpo_lm with `lora`)")
        recorded = str(lora.meta(directory).get("base_sha256"))
        base = self._base_with(recorded)
        if base is None:
            raise _Refused(f"the LoRA adapter in {path} was trained on a base model with sha256 "
                           f"{recorded[:16]}..., which this gateway has not loaded")
        try:
            self.registry.add_runtime(project_id, name, lambda: self.registry.make_engine(
                directory, name=name, share_base=True, base=base))
        except AlreadyLoaded:
            raise _Refused(f"The lora adapter '{name}' has already been loaded.",
                           "InvalidUserInput") from None
        except TooManyAdapters as exc:
            raise _Refused(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a file that is not what it says
            raise _Refused(f"Loading lora {name} failed: {type(exc).__name__}: {exc}") from None
        log.info("project %s: LoRA adapter %r loaded from %s", project_id, name, directory)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, project_id: int, body: dict[str, Any]) -> str:
        name = body.get("lora_name")
        if not name and not body.get("lora_int_id"):
            raise _Refused("either 'lora_name' and 'lora_int_id' needs to be provided.",
                           "InvalidUserInput")
        if not isinstance(name, str) or not self.registry.remove_runtime(project_id, name):
            raise _Refused(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        log.info("project %s: LoRA adapter %r unloaded", project_id, name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _own_checkpoint(self, project_id: int, path: str) -> Path:
        """The directory, if it is a checkpoint of one of the project's training jobs in the
        checkpoint storage; otherwise 404, whether or not it exists."""
        from trainer.checkpoints import STORAGE_ALIAS, _storage

        missing = _Refused(f"Loading lora failed: No adapter found for {path} (a LoRA adapter "
                           f"is loaded from a checkpoint directory of one of this project's "
                           f"training jobs)", "NotFoundError", 404)
        if "\x00" in path:
            raise missing
        try:
            root = Path(_storage(STORAGE_ALIAS).path("")).resolve()
        except NotImplementedError:  # a remote storage: no shared directory to load from
            raise missing from None
        directory = Path(path).resolve()
        try:
            name = directory.relative_to(root).as_posix()
        except ValueError:
            raise missing from None
        try:
            calls.check_checkpoint({"checkpoint": {"name": name, "storage": STORAGE_ALIAS}},
                                  project_id)
        except calls.NotYourCheckpoint:
            raise missing from None
        if not directory.is_dir():
            raise missing
        return directory

    def _base_with(self, sha: str) -> str | None:
        """A base model directory this gateway has loaded whose sha256 is `sha`."""
        for name, shared in adapters.shared_bases():
            if shared.sha256 == sha:
                return name
        for engine in self.registry.deployment_engines():
            if engine.shared is not None:
                continue
            with self._sha_lock:
                if engine.path not in self._shas:
                    directory = models.resolve(engine.path)
                    self._shas[engine.path] = (models.base_sha256(directory), str(directory))
                known, directory = self._shas[engine.path]
            if known == sha:
                return directory
        return None
