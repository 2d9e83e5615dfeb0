"""drf-spectacular hooks: how our key authentication, our error answers and the `null` answers
appear in the schema (/api/schema/). The schema describes what this server answers; where that
differs from AGL 0.3's protocol, it is this server that it describes.

Error answers are declared per operation from the view that serves it (its roles, its path
parameters, whether it reads a body or query parameters), by `declare_errors`, a
postprocessing hook (settings.SPECTACULAR_SETTINGS["POSTPROCESSING_HOOKS"]).
"""

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

    def get_security_requirement(self, auto_schema: Any) -> list[dict[str, list]]:
        # Either scheme, not both: one security requirement object per scheme.
        return [{name: []} for name in self.name]


# Named choice sets for the schema (settings.SPECTACULAR_SETTINGS["ENUM_NAME_OVERRIDES"]).
ROLLOUT_STATUSES = [(v, v) for v in RolloutStatus.values]
ATTEMPT_STATUSES = [(v, v) for v in AttemptStatus.values]
WORKER_STATUSES = [(v, v) for v in WorkerStatus.values]


# --- error answers ---------------------------------------------------------------------------

ERROR = "Error"
VALIDATION_ERROR = "ValidationError"
COMPONENTS = {
    ERROR: {
        "type": "object",
        "description": "`detail` is a message; for a few 400s (a span's size limits), an "
                       "object naming the field at fault.",
        "properties": {"detail": {"anyOf": [
            {"type": "string"}, {"type": "object", "additionalProperties": {}},
        ]}},
        "required": ["detail"],
    },
    VALIDATION_ERROR: {
        "type": "object",
        "description": "FastAPI's shape, as AGL 0.3 answers: `loc` starts with `body`, "
                       "`query` or `path`, then the field.",
        "properties": {"detail": {"type": "array", "items": {
            "type": "object",
            "properties": {
                "loc": {"type": "array",
                        "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
                "msg": {"type": "string"},
                "type": {"type": "string"},
            },
            "required": ["loc", "msg", "type"],
        }}},
        "required": ["detail"],
    },
}

RETRY_AFTER = {"Retry-After": {
    "description": "Seconds to wait before repeating the request (it is safe to repeat).",
    "required": True, "schema": {"type": "integer", "minimum": 0},
}}
CANCELLED = {"X-Cancelled-Rollouts": {
    "description": "Comma-separated ids of cancelled rollouts among those this request "
                   "touched: the runner should stop them.",
    "schema": {"type": "string"},
}}
WWW_AUTHENTICATE = {"WWW-Authenticate": {"schema": {"type": "string"}}}

DESCRIPTIONS = {
    400: "A request line too long for the front server (uvicorn's text answer), malformed "
         "JSON or OTLP, an explicit null where AGL refuses one, an unknown `sort_by`, a bad "
         "`limit`/`offset`, a span over its size limits, or a value the database refuses.",
    401: "No key, or a wrong or revoked key.",
    403: "This key's role may not do this.",
    404: "No such id in this key's project.",
    409: "Not allowed in the object's current state (a finished attempt given another verdict, "
         "a finished rollout's input changed, resources in use).",
    408: "The body did not arrive in time (the ASGI front, WEB_BODY_TIMEOUT_SECONDS).",
    411: "A chunked body (no Content-Length) where the server in front does not end it.",
    414: "The request line is too long (gunicorn, before the app; uvicorn answers 400).",
    413: "The request body (or its spans) is over the size limits.",
    415: "Unsupported Content-Type.",
    422: "Invalid input: the field at fault is named in `loc`.",
    429: "Too many concurrent waits for this key or project: retry after `Retry-After`.",
    503: "The store's database is unavailable: retry after `Retry-After`.",
}

# Operations (by operationId) whose store call can refuse a state change (409).
CONFLICTS = frozenset({
    "update_rollout", "update_attempt", "finish_attempt", "update_attempts_batch",
    "delete_resources",
})
# Operations without a path id that name ids in their body (404 when one is unknown).
NOT_FOUND_IN_BODY = frozenset({
    "update_attempts_batch", "add_span", "add_spans_batch", "get_next_span_sequence_id",
})
# Server-side waits, capped per key and per project (429).
WAITS = frozenset({"wait_for_rollouts", "dequeue_rollouts"})
# Operations whose answer may name cancelled rollouts in X-Cancelled-Rollouts.
CANCELLING = frozenset({
    "update_attempt", "update_attempts_batch", "add_span", "add_spans_batch", "otlp_traces",
})
# Operations that answer `null` (AGL's "none") with their success status.
NULL_ANSWERS = {
    "get_worker": "a worker this project never saw",
    "claim_rollout": "the rollout is not queued (any more)",
    "add_span": "a duplicate span",
    "get_attempt": "`latest` of a rollout without attempts",
    "get_latest_resources": "no resources yet",
}
# Operations with path ids that never answer 404 (`null`, an empty page, or an upsert).
NEVER_NOT_FOUND = frozenset({
    "get_worker", "update_worker", "claim_rollout", "query_attempts", "search_attempts",
})
# Path ids that an operation creates, so bounded as the store bounds them (422 past that).
PATH_MAX_LENGTH = {("update_worker", "worker_id"): 200, ("update_resources", "resources_id"): 40}
# Operations whose JSON body may be absent or `null` (taken as `{}`: StoreView.body).
OPTIONAL_BODY = frozenset({
    "dequeue_rollouts", "claim_rollout", "search_rollouts", "update_rollout", "start_attempt",
    "search_attempts", "update_attempt", "search_workers", "update_worker", "set_quota",
})
RESOURCES_BODY = {
    "type": "object",
    "description": "`{name: resource}`; each resource an object tagged by `resource_type`.",
    "additionalProperties": {
        "type": "object",
        "properties": {"resource_type": {"type": "string", "nullable": True}},
    },
}
# Request bodies drf-spectacular cannot see (views that validate the body themselves).
OTLP_JSON = {"description": "OTLP's JSON encoding (protobuf's JSON mapping; 400 if it is not)."}
BODIES = {"add_resources": RESOURCES_BODY, "update_resources": RESOURCES_BODY,
          "otlp_traces": OTLP_JSON, "otlp_metrics": OTLP_JSON, "otlp_logs": OTLP_JSON,
          "otlp_profiles": {"description": "Anything: accepted and dropped."}}
# Query parameters that views read themselves.
QUERY = {"get_resources_by_id": {"version": {"type": "integer", "minimum": 1,
                                             "maximum": 2**31 - 1}}}

# Fields where an explicit `null` is AGL's 400 (views' `refuse_nulls`): not nullable here.
NOT_NULL = {
    "UpdateRolloutInRequest": ("status", "config"),
    "UpdateAttemptInRequest": ("status", "worker_id", "last_heartbeat_time", "metadata"),
    "UpdateWorkerInRequest": ("heartbeat_stats",),
}


def _error(status: int, schema: str = ERROR, headers: dict | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": DESCRIPTIONS[status],
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }
    if headers:
        response["headers"] = headers
    return response


def _statuses(view: type, method: str, operation: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Every error status the view can answer for this method."""
    from store.api.auth import ANY_ROLE

    op_id = operation.get("operationId", "")
    params = operation.get("parameters", [])
    in_path = any(p["in"] == "path" for p in params)
    in_query = any(p["in"] == "query" for p in params)
    has_body = "requestBody" in operation
    keyed = bool(view.authentication_classes)
    # Any request: a request line over the front server's limit (uvicorn: 400 in text;
    # gunicorn: 414), a body not received in time (408, the ASGI front), a chunked body where
    # the server does not end it (411, Django under a WSGI server, base.py), too large (413).
    bad_request = _error(400)
    bad_request["content"]["text/plain"] = {"schema": {"type": "string"}}
    out: dict[int, dict[str, Any]] = {
        400: bad_request, 408: _error(408), 411: _error(411), 413: _error(413),
        414: {"description": DESCRIPTIONS[414],
              "content": {"text/html": {"schema": {"type": "string"}}}},
    }
    if has_body:
        out[415] = _error(415)
        out[422] = _error(422, VALIDATION_ERROR)
    if in_query:
        out[422] = _error(422, VALIDATION_ERROR)
    if (op_id, "worker_id") in PATH_MAX_LENGTH or (op_id, "resources_id") in PATH_MAX_LENGTH:
        out[422] = _error(422, VALIDATION_ERROR)
    if keyed:
        out[401] = _error(401, headers=WWW_AUTHENTICATE)
        out[503] = _error(503, headers=RETRY_AFTER)
        if getattr(view, f"{method}_roles", ANY_ROLE) != ANY_ROLE:
            out[403] = _error(403)
    if (in_path and op_id not in NEVER_NOT_FOUND) or op_id in NOT_FOUND_IN_BODY:
        out[404] = _error(404)
    if op_id in CONFLICTS:
        out[409] = _error(409)
    if op_id in WAITS:
        out[429] = _error(429, headers=RETRY_AFTER)
    return out


def _nullable(operation: dict[str, Any], why: str) -> None:
    for status, response in operation["responses"].items():
        if not str(status).startswith("2"):
            continue
        media = response.get("content", {}).get("application/json")
        if media is None:
            continue
        media["schema"] = {"allOf": [media["schema"]], "nullable": True}
        response["description"] = (response.get("description") or "") + f" `null`: {why}."


def _exact_path_parameters(operation: dict[str, Any]) -> None:
    """Ids in the path: never blank, never a `/`. (`search` as a rollout, attempt or worker id,
    and `latest` as a resources id, reach another route.)"""
    for param in operation.get("parameters", []):
        if param["in"] != "path":
            continue
        schema: dict[str, Any] = {"type": "string", "minLength": 1, "pattern": "^[^/]+$"}
        longest = PATH_MAX_LENGTH.get((operation.get("operationId"), param["name"]))
        if longest:
            schema["maxLength"] = longest
        param["schema"] = schema


def _exact_body_and_query(operation: dict[str, Any]) -> None:
    op_id = operation.get("operationId", "")
    body = operation.get("requestBody")
    if body is not None:
        if op_id in BODIES:
            body["content"]["application/json"]["schema"] = BODIES[op_id]
        if op_id in OPTIONAL_BODY:
            body["required"] = False
            media = body["content"]["application/json"]
            media["schema"] = {"allOf": [media["schema"]], "nullable": True}
        elif op_id.startswith("otlp_"):
            body["required"] = True
    for param in operation.get("parameters", []):
        exact = QUERY.get(op_id, {}).get(param["name"])
        if param["in"] == "query" and exact is not None:
            param["schema"] = exact


def _not_null(schemas: dict[str, Any]) -> None:
    for component, fields in NOT_NULL.items():
        properties = schemas.get(component, {}).get("properties", {})
        for name in fields:
            field = properties.get(name)
            if field is None:
                continue
            field.pop("nullable", None)
            for key in ("oneOf", "anyOf"):
                choices = [c for c in field.get(key, [])
                           if c.get("$ref") != "#/components/schemas/NullEnum"]
                if key in field and len(choices) == 1:
                    del field[key]
                    field.update(choices[0])


def declare_errors(result: dict[str, Any], generator: Any, request: Any,
                   public: bool) -> dict[str, Any]:
    views = {(path, method.lower()): callback.cls
             for path, _regex, method, callback in generator.endpoints}
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(COMPONENTS)
    _not_null(schemas)
    for path, operations in result.get("paths", {}).items():
        for method, operation in operations.items():
            view = views.get((path, method))
            if view is None:
                continue
            _exact_path_parameters(operation)
            _exact_body_and_query(operation)
            responses = operation.setdefault("responses", {})
            for status, response in _statuses(view, method, operation).items():
                responses.setdefault(str(status), response)
            if operation.get("operationId") in CANCELLING:
                for status, response in responses.items():
                    if str(status).startswith("2"):
                        response.setdefault("headers", {}).update(CANCELLED)
            why = NULL_ANSWERS.get(operation.get("operationId", ""))
            if why:
                _nullable(operation, why)
    return result
