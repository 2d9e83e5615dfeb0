"""Turns of an attempt: does each call's prompt extend the previous call's prompt and
response ids? `aggregation: trajectory` makes one training sample of a multi-turn episode only
when they do; a call that does not is a re-tokenization mismatch (on its span, and counted)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from trainer.llm.calls import Attribution


class Turns:
    """The last call of each attempt (its prompt plus each choice's response ids), to tell
    whether the next call's prompt starts with them (what `aggregation: trajectory` needs to
    make one sample of a multi-turn episode) and to render the next prompt from them. Kept in
    this process, for the most recent `size` attempts."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        # attempt -> (idempotency key, its ids, the ids of the call before it)
        self._last: OrderedDict[tuple, tuple[str | None, list[list[int]], list[list[int]]]] = \
            OrderedDict()
        self._lock = threading.Lock()

    def previous(self, attribution: Attribution, key: str | None = None) -> list[list[int]]:
        """The ids the next call may extend (for a retry under the same key: those its
        first try saw)."""
        with self._lock:
            last = self._last.get(self._where(attribution))
        if last is None:
            return []
        return last[2] if key is not None and last[0] == key else last[1]

    def follow(self, attribution: Attribution, prompt_ids: list[int],
               responses: list[list[int]], key: str | None = None) -> bool | None:
        """Whether this call extends the attempt's previous one (None: there was none, or
        this is a retry of it under the same idempotency key)."""
        where = self._where(attribution)
        with self._lock:
            last = self._last.get(where)
            if last is not None and key is not None and last[0] == key:
                return None
            ids = [list(prompt_ids) + list(r) for r in responses]
            self._last[where] = (key, ids, last[1] if last is not None else [])
            self._last.move_to_end(where)
            while len(self._last) > self.size:
                self._last.popitem(last=False)
        if last is None:
            return None
        return any(prompt_ids[:len(ids)] == ids for ids in last[1])

    @staticmethod
    def _where(attribution: Attribution) -> tuple[int, str, str]:
        return attribution.project.pk, attribution.rollout_id, attribution.attempt_id
