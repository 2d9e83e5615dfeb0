"""Which keys a job's config may hold: the trainer's own and those its algorithm declares.

A key nobody reads is a typo or a setting of another algorithm; a job created with one would
run as if it were not there (a failure that looks like success: `--set lrr=0.1` trains at the
default rate), so job creation refuses it, naming the key and the nearest known one.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any


def unknown_key_error(config: Mapping[str, Any], *, job_keys: Iterable[str],
                      algorithm: str, declared: Iterable[str] | None) -> tuple[str, str] | None:
    """(field, message) for the first key (sorted) of `config` that is neither in `job_keys`
    nor in `declared` (the algorithm's `config_keys` plus the base class's); None when every
    key is known or when the algorithm declares nothing (`declared` None: not checked)."""
    if declared is None:
        return None
    known = set(job_keys) | set(declared)
    unknown = sorted(str(key) for key in config if key not in known)
    if not unknown:
        return None
    key = unknown[0]
    near = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    others = f"; also unknown: {', '.join(unknown[1:])}" if len(unknown) > 1 else ""
    return (f"config.{key}",
            f"unknown key{hint}: neither the trainer nor the algorithm {algorithm!r} reads it"
            f"{others} (an algorithm declares the keys it reads in `config_keys`). Known keys: "
            f"{', '.join(sorted(known))}")
