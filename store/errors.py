"""Typed errors raised by the store services; the API maps them to HTTP statuses."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class NotFound(StoreError):
    def __init__(self, kind: str, ident: object) -> None:
        super().__init__(f"{kind} {ident!r} not found")
        self.kind = kind
        self.ident = ident


class IllegalTransition(StoreError):
    def __init__(self, kind: str, ident: object, current: str, requested: str) -> None:
        super().__init__(f"{kind} {ident!r} cannot go from {current!r} to {requested!r}")
        self.kind = kind
        self.ident = ident
        self.current = current
        self.requested = requested


class InvalidInput(StoreError, ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ResourceInUse(StoreError):
    """A resources version that unfinished rollouts still refer to cannot be deleted."""
