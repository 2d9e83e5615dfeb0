"""Job specs: where `manage.py train TARGET` finds one, and the check every spec passes
before a job is created (one line per problem, naming the field, never a traceback).

A spec is a mapping: `agent` (the agent's dotted path), `algorithm` (a built-in name or an
Algorithm's dotted path), `config` (an object), `train_dataset` (a list), and optionally
`val_dataset` (a list) and `name`. TARGET names one of:

- a module with a `job_spec(seed=..., steps=...)` function (`examples.cipher`), or the dotted
  path of such a function;
- a Python file defining `job_spec` (`./myjob.py`);
- a JSON file holding the spec itself (`./myjob.json`).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from django.utils.module_loading import import_string

SpecSource = Callable[..., Any] | dict[str, Any]

# field -> (types it may have, what it is), in the order they are checked
FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "agent": ((str,), "the agent's dotted path, e.g. 'myagents.math:agent'"),
    "algorithm": ((str,), "a built-in ('grpo', 'grpo_lm', 'baseline') or an Algorithm's path"),
    "config": ((dict,), "an object of the algorithm's settings"),
    "train_dataset": ((list, tuple), "a list of tasks"),
}
OPTIONAL: dict[str, tuple[tuple[type, ...], str]] = {
    "val_dataset": ((list, tuple), "a list of tasks"),
    "name": ((str,), "a string"),
}


class SpecError(ValueError):
    """A spec that cannot be used, said in one line."""


def spec_load(target: str) -> SpecSource:
    """A spec function, or a spec read from a JSON file, from what TARGET names."""
    path = Path(target)
    if target.endswith(".json"):
        return _json_spec(path)
    if target.endswith(".py"):
        return _file_spec(path)
    try:
        module = importlib.import_module(target)
    except ImportError as exc:
        if not _names_target(exc, target):  # the module is there; something it imports is not
            raise SpecError(f"{target}: importing it failed: {exc}") from None
        module = None
    if module is not None:
        if not hasattr(module, "job_spec"):
            raise SpecError(f"{target}: the module has no job_spec() function")
        return module.job_spec
    try:
        return import_string(target)
    except ImportError as exc:
        raise SpecError(f"{target!r} names no job spec (a module with job_spec(), its dotted "
                        f"path, a .py or a .json file): {exc}") from None


def _names_target(exc: ImportError, target: str) -> bool:
    """The import failed because `target` (or a package on its path) is not a module."""
    name = getattr(exc, "name", None)
    return not name or target == name or target.startswith(name + ".")


def _json_spec(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the spec: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None


def _file_spec(path: Path) -> Callable[..., Any]:
    if not path.is_file():
        raise SpecError(f"{path}: no such file")
    loader = importlib.util.spec_from_file_location(f"_job_spec_{path.stem}", path)
    module = importlib.util.module_from_spec(loader)
    try:
        loader.loader.exec_module(module)
    except Exception as exc:  # the user's file: whatever it raises is said in one line
        raise SpecError(f"{path}: loading it failed: {exc!r}") from None
    function = getattr(module, "job_spec", None)
    if not callable(function):
        raise SpecError(f"{path}: the file defines no job_spec() function")
    return function


def spec_build(source: SpecSource, *, where: str, seed: int | None,
               steps: int | None) -> dict[str, Any]:
    """The checked spec: a function is called with the seed and steps given; a spec read
    from a file takes them into its config."""
    if callable(source):
        try:
            spec = source(seed=seed or 0, **({"steps": steps} if steps is not None else {}))
        except Exception as exc:  # the user's function
            raise SpecError(f"{where}: job_spec() failed: {exc!r}") from None
        return spec_check(spec, where=where)
    spec = spec_check(source, where=where)
    overrides = {"seed": seed, "steps": steps}
    spec["config"].update({k: v for k, v in overrides.items() if v is not None})
    return spec


def spec_check(spec: Any, *, where: str) -> dict[str, Any]:
    """The spec as a new dict, or SpecError naming the first field that is missing or of the
    wrong type."""
    if not isinstance(spec, Mapping):
        raise SpecError(f"{where}: a job spec must be an object (a dict), got "
                        f"{type(spec).__name__}")
    for name, (types, what) in FIELDS.items():
        if name not in spec:
            raise SpecError(f"{where}: the spec has no {name!r} ({what})")
        _check_type(spec, name, types, what, where)
    for name, (types, what) in OPTIONAL.items():
        if spec.get(name) is not None:
            _check_type(spec, name, types, what, where)
    if not spec["train_dataset"] and not spec.get("val_dataset"):
        raise SpecError(f"{where}: the spec has no tasks ('train_dataset' and 'val_dataset' "
                        "are empty)")
    checked = dict(spec)
    checked["config"] = dict(spec["config"])
    return checked


def _check_type(spec: Mapping[str, Any], name: str, types: tuple[type, ...], what: str,
                where: str) -> None:
    if not isinstance(spec[name], types):
        raise SpecError(f"{where}: {name!r} must be {what}, got {type(spec[name]).__name__}")
