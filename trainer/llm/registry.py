"""Which checkpoint versions the gateway has loaded, and which one serves a call.

A model is known by name: from LLM_GATEWAY_MODELS (a directory, version 0) or from the `llm`
resource a training job publishes (trainer/algorithms/grpo_lm.py), which names the model, its
version and its checkpoint. A call attributed to a rollout that pinned version k is served by
k while k is loaded, or when k is newer than every loaded version (it is then loaded: a hot
reload); otherwise by the newest loaded version. At most `max_versions` versions of a model
stay loaded: the oldest is dropped, and requests already running on it finish on it.

A poller (`watch`) follows the resources ids of the jobs whose calls it served and loads each
newly published version as soon as the store has it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainer.llm.engine import Engine

log = logging.getLogger(__name__)


class UnknownModel(LookupError):
    pass


@dataclass
class _Model:
    versions: dict[int, Engine] = field(default_factory=dict)
    load_lock: threading.Lock = field(default_factory=threading.Lock)

    def newest(self) -> Engine | None:
        return self.versions[max(self.versions)] if self.versions else None


class Registry:
    def __init__(self, *, max_versions: int = 2,
                 loader: Callable[[dict[str, Any], str, int], Engine] | None = None) -> None:
        self.max_versions = max_versions
        self._models: dict[str, _Model] = {}
        self._lock = threading.Lock()
        self._loader = loader or _load_checkpoint
        self.loads = 0  # versions loaded so far (hot reloads included)

    def add_directory(self, name: str, path: str, version: int = 0) -> Engine:
        return self._install(name, version, lambda: Engine(path, version=version, name=name))

    def names(self) -> list[str]:
        with self._lock:
            return sorted(n for n, m in self._models.items() if m.versions)

    def loaded_versions(self, name: str) -> list[int]:
        with self._lock:
            model = self._models.get(name)
            return sorted(model.versions) if model else []

    def by_name(self, name: str) -> Engine:
        """The newest loaded version of a model (unattributed calls)."""
        with self._lock:
            model = self._models.get(name)
            engine = model.newest() if model else None
        if engine is None:
            raise UnknownModel(name)
        return engine

    def for_resource(self, llm: dict[str, Any]) -> Engine:
        """The engine for a call whose rollout pinned this `llm` resource (see the module
        docstring for which version serves it)."""
        name, version = str(llm["model"]), int(llm.get("version") or 0)
        with self._lock:
            model = self._models.setdefault(name, _Model())
            if version in model.versions:
                return model.versions[version]
            newest = model.newest()
        if newest is not None and newest.version > version:
            return newest
        checkpoint = llm.get("checkpoint")
        if not checkpoint:
            if newest is not None:
                return newest
            raise UnknownModel(name)
        return self._install(name, version, lambda: self._loader(checkpoint, name, version))

    def _install(self, name: str, version: int, load: Callable[[], Engine]) -> Engine:
        with self._lock:
            model = self._models.setdefault(name, _Model())
        with model.load_lock:  # one load per model at a time; others wait, then find it
            with self._lock:
                if version in model.versions:
                    return model.versions[version]
            engine = load()  # outside the registry's lock: other models keep serving
            with self._lock:
                model.versions[version] = engine
                self.loads += 1
                while len(model.versions) > self.max_versions:
                    dropped = model.versions.pop(min(model.versions))
                    log.debug("model %s: version %s unloaded", name, dropped.version)
            log.debug("model %s: version %s loaded from %s", name, version, engine.path)
            return engine


def _load_checkpoint(checkpoint: dict[str, Any], name: str, version: int) -> Engine:
    from trainer.checkpoints import checkpoint_local_dir

    return Engine(checkpoint_local_dir(checkpoint), version=version, name=name)
