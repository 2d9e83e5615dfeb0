"""Attempt tokens: a credential good for one attempt's LLM calls only.

A Celery worker runs agents with database access and no project key; the agent's `llm`
resource carries this token as its `api_key` instead, so the model gateway can check that the
caller runs that very attempt (`lat_` + project id + HMAC of project, rollout and attempt,
keyed by SECRET_KEY). Remote runners may use their project key instead.
"""

from __future__ import annotations

import hashlib
import hmac

from django.conf import settings

PREFIX = "lat_"


def attempt_token(*, project_id: int, rollout_id: str, attempt_id: str) -> str:
    return f"{PREFIX}{project_id}_{_mac(project_id, rollout_id, attempt_id)}"


def attempt_token_project(token: str, *, rollout_id: str, attempt_id: str) -> int | None:
    """The project id a token was issued for, when it is valid for this attempt; else None."""
    if not token.startswith(PREFIX):
        return None
    project, _, mac = token[len(PREFIX):].partition("_")
    if not project.isdigit():
        return None
    if hmac.compare_digest(mac, _mac(int(project), rollout_id, attempt_id)):
        return int(project)
    return None


def _mac(project_id: int, rollout_id: str, attempt_id: str) -> str:
    message = f"{project_id}:{rollout_id}:{attempt_id}".encode()
    return hmac.new(settings.SECRET_KEY.encode(), message, hashlib.sha256).hexdigest()[:32]
