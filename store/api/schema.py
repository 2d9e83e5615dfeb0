"""drf-spectacular hooks: how our key authentication and the span field appear in the schema."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension

from store.statemachine import AttemptStatus, RolloutStatus, WorkerStatus


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = "store.api.auth.ApiKeyAuthentication"
    name = ["ApiKeyBearer", "ApiKeyBasic"]

    def get_security_definition(self, auto_schema: Any) -> list[dict[str, Any]]:
        return [
            {"type": "http", "scheme": "bearer",
             "description": "A project API key: `Authorization: Bearer KEY`."},
            {"type": "http", "scheme": "basic",
             "description": "The key as the password (`http://runner:KEY@host:port`)."},
        ]


# Named choice sets for the schema (settings.SPECTACULAR_SETTINGS["ENUM_NAME_OVERRIDES"]).
ROLLOUT_STATUSES = [(v, v) for v in RolloutStatus.values]
ATTEMPT_STATUSES = [(v, v) for v in AttemptStatus.values]
WORKER_STATUSES = [(v, v) for v in WorkerStatus.values]
