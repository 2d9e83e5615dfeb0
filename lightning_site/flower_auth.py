"""`python -m lightning_site.flower_auth`: exits 1 unless FLOWER_BASIC_AUTH holds real
credentials, so Flower never starts open (docker-compose.yml runs it before Flower).

Flower splits the variable on commas and lets a request in whose Basic credentials equal any
entry: an empty variable is the entry `''`, which `Authorization: Basic ====` (decoded: empty)
matched, and Flower can revoke and terminate tasks. Each entry must be `user:password`, both
parts non-empty, and the password at least MIN_PASSWORD characters."""

from __future__ import annotations

import os
import sys

MIN_PASSWORD = 8


def problem(value: str | None) -> str | None:
    """Why `value` is not a safe FLOWER_BASIC_AUTH, or None when it is."""
    if not value or not value.strip():
        return "FLOWER_BASIC_AUTH is empty; set it to user:password"
    for entry in value.split(","):
        user, sep, password = entry.partition(":")
        if not sep or not user.strip() or not password.strip():
            return f"FLOWER_BASIC_AUTH entry {entry!r} must be user:password, neither part empty"
        if len(password) < MIN_PASSWORD:
            return f"FLOWER_BASIC_AUTH password of user {user!r} is under {MIN_PASSWORD} characters"
    return None


def main() -> int:
    reason = problem(os.environ.get("FLOWER_BASIC_AUTH"))
    if reason:
        print(f"error: {reason}; Flower is not started", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
