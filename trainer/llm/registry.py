"""Which checkpoint versions the gateway has loaded, and which one serves a call.

Models live in namespaces (`Space`), so that no tenant can serve, list or load another's:
- the deployment's models (LLM_GATEWAY_MODELS: a directory each, version 0), project 0,
  callable by every project;
- a training job's models, keyed by (project, resources id, model name): the `llm` resource a
  job publishes (trainer/algorithms/grpo_lm.py) names the model, its version and its
  checkpoint. Two jobs that publish the same model name and versions never share an engine,
  and a key can publish only into its own project's resources, so it cannot reach another
  project's calls.

A call attributed to a rollout that pinned version k of its resources is served by k while k
is loaded, or when k is newer than every loaded version (it is then loaded: a hot reload);
otherwise by the newest loaded version. At most `max_versions` versions of a space stay
loaded (the oldest is dropped; requests already running on it finish on it), and at most
`max_spaces` spaces per project (the least recently used is dropped). An unattributed call
names a model: its own project's most recently used space of that name, else the
deployment's.

Runtime LoRA adapters (runtime_lora.py: vLLM's `/v1/load_lora_adapter`) are spaces of their
own (`Space.runtime`), named by the caller, version 0, in the loading key's project only: at
most `max_spaces` of them per project (one more is refused, never evicted: the upstream that
loaded it routes calls to it), unloaded only by `/v1/unload_lora_adapter`.

A poller (gateway.watch) follows the resources ids of the jobs whose calls it served and loads
each newly published version as soon as the store has it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainer.llm.engine import Engine
from trainer.llm.engine_client import EngineStopped

log = logging.getLogger(__name__)
DEPLOYMENT = 0  # the project id of the deployment's own models


class UnknownModel(LookupError):
    pass


class AlreadyLoaded(ValueError):
    pass


class TooManyAdapters(ValueError):
    pass


@dataclass(frozen=True)
class Space:
    project_id: int
    resources_id: str
    model: str
    runtime: bool = False  # a runtime LoRA adapter (loaded by name, not by a job's resources)


@dataclass
class _Model:
    versions: dict[int, Engine] = field(default_factory=dict)
    load_lock: threading.Lock = field(default_factory=threading.Lock)
    used: float = 0.0  # time.monotonic() of the last call served

    def newest(self) -> Engine | None:
        return self.versions[max(self.versions)] if self.versions else None


class Registry:
    def __init__(self, *, max_versions: int = 2, max_spaces: int = 4,
                 loader: Callable[[dict[str, Any], str, int], Engine] | None = None,
                 share_base: bool = False,
                 make_engine: Callable[..., Engine] | None = None) -> None:
        self.max_versions = max_versions
        self.max_spaces = max_spaces  # per project
        self._models: dict[Space, _Model] = {}
        self._lock = threading.Lock()
        # Engine(path, **kwargs) in this process, or the engine process's (engine_client.py)
        self.make_engine = make_engine or Engine
        # share_base: LoRA checkpoints as adapters on one copy of their base (adapters.py)
        self._loader = loader or (lambda checkpoint, name, version: _load_checkpoint(
            checkpoint, name, version, share_base=share_base, make_engine=self.make_engine))
        self.loads = 0  # versions loaded so far (hot reloads included)

    def add_directory(self, name: str, path: str, version: int = 0) -> Engine:
        return self._install(Space(DEPLOYMENT, "", name), version,
                             lambda: self.make_engine(path, version=version, name=name))

    def names(self, project_id: int = DEPLOYMENT) -> list[str]:
        """The model names a project may call: the deployment's and its own."""
        with self._lock:
            return sorted({s.model for s, m in self._models.items()
                           if m.versions and s.project_id in (DEPLOYMENT, project_id)})

    def spaces(self, project_id: int) -> list[Space]:
        with self._lock:
            return [s for s, m in self._models.items() if m.versions and s.project_id == project_id]

    def loaded_versions(self, space: Space | str) -> list[int]:
        """The versions loaded in a space (a bare name: the deployment's model)."""
        if isinstance(space, str):
            space = Space(DEPLOYMENT, "", space)
        with self._lock:
            model = self._models.get(space)
            return sorted(model.versions) if model else []

    def add_runtime(self, project_id: int, name: str, load: Callable[[], Engine]) -> Engine:
        """Load a runtime LoRA adapter named `name` in the project's namespace (AlreadyLoaded:
        the name is taken, or being loaded; TooManyAdapters: the project has max_spaces)."""
        space = Space(project_id, "", name, runtime=True)
        with self._lock:
            if space in self._models:
                raise AlreadyLoaded(name)
            held = sum(1 for s in self._models if s.runtime and s.project_id == project_id)
            if held >= self.max_spaces:
                raise TooManyAdapters(f"this project has {held} LoRA adapters loaded (at most "
                                      f"{self.max_spaces}); unload one first")
            model = self._models[space] = _Model(used=time.monotonic())  # reserved meanwhile
        try:
            engine = load()
        except BaseException:
            with self._lock:
                self._models.pop(space, None)
            raise
        with self._lock:
            model.versions[0] = engine
            self.loads += 1
        return engine

    def remove_runtime(self, project_id: int, name: str) -> bool:
        """Unload a runtime adapter (calls already holding its engine finish on it)."""
        space = Space(project_id, "", name, runtime=True)
        with self._lock:
            model = self._models.get(space)
            if model is None or not model.versions:  # unknown, or still loading
                return False
            del self._models[space]
            return True

    def runtime_names(self, project_id: int) -> list[str]:
        with self._lock:
            return sorted(s.model for s, m in self._models.items()
                          if s.runtime and s.project_id == project_id and m.versions)

    def deployment_engines(self) -> list[Engine]:
        with self._lock:
            return [m.newest() for s, m in self._models.items()
                    if s.project_id == DEPLOYMENT and m.versions]

    def by_name(self, name: str, *, project_id: int = DEPLOYMENT) -> Engine:
        """The newest loaded version of a model for an unattributed call of `project_id`:
        its own most recently used space of that name, else the deployment's model."""
        with self._lock:
            own = [(m.used, m) for s, m in self._models.items()
                   if s.project_id == project_id != DEPLOYMENT and s.model == name and m.versions]
            model = max(own, key=lambda pair: pair[0])[1] if own else \
                self._models.get(Space(DEPLOYMENT, "", name))
            engine = model.newest() if model else None
            if model is not None:
                model.used = time.monotonic()
        if engine is None:
            raise UnknownModel(name)
        return engine

    def for_resource(self, llm: dict[str, Any], *, project_id: int,
                     resources_id: str) -> Engine:
        """The engine for a call whose rollout pinned this `llm` resource of the project's
        resources `resources_id` (see the module docstring for which version serves it)."""
        name, version = str(llm["model"]), int(llm.get("version") or 0)
        space = Space(project_id, resources_id, name)
        with self._lock:
            model = self._models.get(space)
            if model is not None:
                model.used = time.monotonic()
                if version in model.versions:
                    return model.versions[version]
            newest = model.newest() if model is not None else None
        if newest is not None and newest.version > version:
            return newest
        checkpoint = llm.get("checkpoint")
        if not checkpoint:
            if newest is not None:
                return newest
            raise UnknownModel(name)
        return self._install(space, version, lambda: self._loader(checkpoint, name, version))

    def _install(self, space: Space, version: int, load: Callable[[], Engine]) -> Engine:
        with self._lock:
            model = self._models.setdefault(space, _Model(used=time.monotonic()))
        with model.load_lock:  # one load per space at a time; others wait, then find it
            with self._lock:
                if version in model.versions:
                    return model.versions[version]
            engine = load()  # outside the registry's lock: other models keep serving
            with self._lock:
                self._models[space] = model  # back, if it was dropped while loading
                model.versions[version] = engine
                self.loads += 1
                while len(model.versions) > self.max_versions:
                    dropped = model.versions.pop(min(model.versions))
                    log.debug("model %s: version %s unloaded", space, dropped.version)
                self._cap_spaces(space)
            log.debug("model %s: version %s loaded from %s", space, version, engine.path)
            return engine

    def _cap_spaces(self, keep: Space) -> None:
        """Drop a project's least recently used spaces beyond max_spaces (under the lock)."""
        if keep.project_id == DEPLOYMENT:
            return
        own = sorted(((m.used, s) for s, m in self._models.items()
                      if s.project_id == keep.project_id and s != keep and not s.runtime),
                     key=lambda p: p[0])
        while len(own) + 1 > self.max_spaces:
            _, space = own.pop(0)
            del self._models[space]
            log.info("model %s unloaded: project %s keeps at most %d models loaded",
                     space, space.project_id, self.max_spaces)


def _load_checkpoint(checkpoint: dict[str, Any], name: str, version: int, *,
                     share_base: bool = False,
                     make_engine: Callable[..., Engine] = Engine) -> Engine:
    from trainer.checkpoints import CheckpointError, checkpoint_local_dir

    local = checkpoint_local_dir(checkpoint)  # a storage that is away raises its own error
    try:
        return make_engine(local, version=version, name=name, share_base=share_base)
    except EngineStopped:  # the engine process died while loading: not the checkpoint's fault
        raise
    except Exception as exc:  # the files are here and are not a model: that will not change
        raise CheckpointError(f"checkpoint {checkpoint.get('name')!r} is not a model that "
                              f"loads ({type(exc).__name__}: {exc})") from exc
