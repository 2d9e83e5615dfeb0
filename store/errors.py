"""Typed errors raised by the store services; the API maps them to HTTP statuses."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class NotFound(StoreError):
    """Worded as AGL 0.3's store words it, so AGL's client raises the same message:
    `Rollout <id> not found`, `Attempt <aid> not found for rollout <rid>`."""

    def __init__(self, kind: str, ident: object, message: str | None = None) -> None:
        super().__init__(message or _not_found(kind, ident))
        self.kind = kind
        self.ident = ident


def _not_found(kind: str, ident: object) -> str:
    if kind == "attempt" and isinstance(ident, str) and "/" in ident:
        rollout_id, attempt_id = ident.split("/", 1)
        return f"Attempt {attempt_id} not found for rollout {rollout_id}"
    return f"{kind[:1].upper()}{kind[1:]} {ident} not found"


class IllegalTransition(StoreError):
    def __init__(self, kind: str, ident: object, current: str, requested: str) -> None:
        super().__init__(f"{kind} {ident!r} cannot go from {current!r} to {requested!r}")
        self.kind = kind
        self.ident = ident
        self.current = current
        self.requested = requested


class InvalidInput(StoreError, ValueError):
    """`field` is dotted (`spans[3].name`); `loc`, when given, is the exact location (keys
    may contain dots)."""

    def __init__(self, field: str, message: str, loc: tuple | None = None) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.loc = loc


class FieldFrozen(StoreError):
    """A field that may not change in the object's current state (409): a finished rollout's
    `input` (it is what the rollout ran on)."""

    def __init__(self, kind: str, ident: object, field: str, state: str) -> None:
        super().__init__(
            f"{field} of {kind} {ident} cannot change while it is {state}; requeue it first"
        )
        self.field = field


class BadQuery(StoreError):
    """A request AGL 0.3's server refuses with 400 and a message (bad paging, an explicit
    null for a field that cannot be null)."""


class ResourceInUse(StoreError):
    """A resources version that unfinished rollouts still refer to cannot be deleted."""
