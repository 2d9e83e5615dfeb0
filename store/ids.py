"""Ids in Agent Lightning 0.3's formats (an attempt's: store/rules.py, one generator for the
services and the claim's statement)."""

from __future__ import annotations

import secrets


def new_rollout_id() -> str:
    return "ro-" + secrets.token_hex(6)


def new_resources_id() -> str:
    return "rs-" + secrets.token_hex(6)
