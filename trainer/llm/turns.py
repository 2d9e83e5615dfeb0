"""Turns of an attempt: does each call's prompt extend the previous call's prompt and
response ids? `aggregation: trajectory` makes one training sample of a multi-turn episode only
when they do; a call that does not is a re-tokenization mismatch (on its span, and counted)."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict

from trainer.llm.calls import Attribution


class Turns:
    """The last call of each attempt (its prompt plus each choice's response ids), to tell
    whether the next call's prompt starts with them (what `aggregation: trajectory` needs to
    make one sample of a multi-turn episode) and to render the next prompt from them. Kept in
    this process for the most recently used attempts: at most `max_tokens` ids in all (4 bytes
    each, with the call before each one, which a retry needs), the oldest dropped first."""

    def __init__(self, max_tokens: int = 8_000_000) -> None:
        self.max_tokens = max_tokens
        self.held = 0
        # attempt -> (idempotency key, its ids, the ids of the call before it)
        self._last: OrderedDict[tuple, tuple[str | None, list[array], list[array]]] = \
            OrderedDict()
        self._lock = threading.Lock()

    def previous(self, attribution: Attribution, key: str | None = None) -> list[list[int]]:
        """The ids the next call may extend (for a retry under the same key: those its
        first try saw)."""
        with self._lock:
            last = self._last.get(self._where(attribution))
        if last is None:
            return []
        return [ids.tolist() for ids in (last[2] if key is not None and last[0] == key
                                         else last[1])]

    def follow(self, attribution: Attribution, prompt_ids: list[int],
               responses: list[list[int]], key: str | None = None) -> bool | None:
        """Whether this call extends the attempt's previous one (None: there was none, or
        this is a retry of it under the same idempotency key)."""
        where = self._where(attribution)
        entry = [array("i", [*prompt_ids, *r]) for r in responses]
        with self._lock:
            last = self._last.pop(where, None)
            if last is not None and key is not None and last[0] == key:
                self._last[where] = last
                return None
            if last is not None:
                self.held -= _size(last)
            self._last[where] = (key, entry, last[1] if last is not None else [])
            self.held += _size(self._last[where])
            while self.held > self.max_tokens and len(self._last) > 1:
                self.held -= _size(self._last.popitem(last=False)[1])
        if last is None:
            return None
        prompt = array("i", prompt_ids)
        return any(prompt[:len(ids)] == ids for ids in last[1])

    @staticmethod
    def _where(attribution: Attribution) -> tuple[int, str, str]:
        return attribution.project.pk, attribution.rollout_id, attribution.attempt_id


def _size(entry: tuple[str | None, list[array], list[array]]) -> int:
    return sum(len(ids) for ids in entry[1]) + sum(len(ids) for ids in entry[2])
