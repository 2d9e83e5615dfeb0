"""A client's retry of a call that sent no idempotency key is the same call, recorded once.

The OpenAI Python client (what an agent brings) retries a call that timed out or failed
(`max_retries`, 2 by default) with the same body and no idempotency key, only the header
`x-stainless-retry-count: N` (0 on the first try). When the first try was served and recorded
but its answer never reached the agent (a read timeout under load), the retry was recorded as a
second call: the token adapter then trained on a turn the agent never saw (two sync runs of the
LLM example parted this way: README "Benchmarks", async).

So every call of an attempt without a key gets one of its own (`auto-...`), and a retry (N >= 1)
of the attempt's last call with the same body (sha256) gets that call's key: the gateway's
idempotency rules then apply (the same span ids, which the store keeps once; the same response
id; the call it extended). A retry whose body differs, or whose first try was forgotten (this
process restarted, or more than `max_attempts` attempts since), is a new call, as before.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict

from trainer.llm.calls import Attribution

RETRY_HEADER = "x-stainless-retry-count"
AUTO_PREFIX = "auto-"


class Retries:
    """The last keyless call of each attempt, (its key, its body's sha256), for the most
    recently used `max_attempts` attempts of this process."""

    def __init__(self, max_attempts: int = 100_000) -> None:
        self.max_attempts = max_attempts
        self._last: OrderedDict[tuple[int, str, str], tuple[str, str]] = OrderedDict()
        self._lock = threading.Lock()

    def key_for(self, attribution: Attribution, digest: str, retry_count: str | None
                ) -> tuple[str, bool]:
        """The key of a call sent without one, and whether it is a retry of the attempt's last
        call (the same body, and the client says it is retrying)."""
        where = (attribution.project.pk, attribution.rollout_id, attribution.attempt_id)
        with self._lock:
            last = self._last.get(where)
            if last is not None and _is_retry(retry_count) and last[1] == digest:
                self._last.move_to_end(where)
                return last[0], True
            key = AUTO_PREFIX + secrets.token_hex(12)
            self._last[where] = (key, digest)
            self._last.move_to_end(where)
            while len(self._last) > self.max_attempts:
                self._last.popitem(last=False)
        return key, False


def _is_retry(count: str | None) -> bool:
    try:
        return count is not None and int(count) >= 1
    except ValueError:
        return False
