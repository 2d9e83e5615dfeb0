"""schemathesis hooks for tests/api/schemathesis.toml (SCHEMATHESIS_HOOKS): keep server-side
waits short so the run stays bounded in time. Only values the schema allows are shortened
(an out-of-range value stays out of range, for the negative checks)."""

from __future__ import annotations

import schemathesis

# The schema's upper bound of each wait field (serializers.DequeueIn, WaitForRolloutsIn).
_WAITS = {"wait_seconds": 20.0, "timeout": 3.2e9}
_SHORT = 0.2


@schemathesis.hook
def map_body(ctx, body):  # noqa: ANN001, ANN201 - schemathesis' hook signature
    if isinstance(body, dict):
        for name, most in _WAITS.items():
            value = body.get(name)
            if (isinstance(value, int | float) and not isinstance(value, bool)
                    and _SHORT < value <= most):
                body[name] = _SHORT
        cap = body.get("max_concurrent_rollouts")
        if isinstance(cap, int) and not isinstance(cap, bool) and 0 <= cap <= 2**31 - 1:
            # A project capped by one case (set_share) holds every later dequeue of the run
            # for its whole wait: allowed caps are lifted (null, also allowed) instead.
            body["max_concurrent_rollouts"] = None
    return body
