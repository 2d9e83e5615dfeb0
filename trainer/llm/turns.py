"""Turns of an attempt: does each call's prompt extend the previous call's prompt and
response ids? `aggregation: trajectory` makes one training sample of a multi-turn episode only
when they do; a call that does not is a re-tokenization mismatch (on its span, and counted)."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from trainer.llm.calls import Attribution
from trainer.llm.tools import Previous


class Turns:
    """The last call of each attempt (its prompt plus each choice's response ids, and the text
    of its tool calls), to tell whether the next call's prompt starts with them (what
    `aggregation: trajectory` needs to make one sample of a multi-turn episode) and to render
    the next prompt from them. Kept in this process for the most recently used attempts: at
    most `max_tokens` ids in all (4 bytes each, with the call before each one, which a retry
    needs), the oldest dropped first."""

    def __init__(self, max_tokens: int = 8_000_000) -> None:
        self.max_tokens = max_tokens
        self.held = 0
        # attempt -> (idempotency key, its call, the call before it)
        self._last: OrderedDict[tuple, tuple[str | None, _Call, _Call]] = OrderedDict()
        self._lock = threading.Lock()

    def previous(self, attribution: Attribution, key: str | None = None) -> Previous | None:
        """The call the next one may extend (for a retry under the same key: the one its
        first try extended)."""
        with self._lock:
            last = self._last.get(self._where(attribution))
        if last is None:
            return None
        call = last[2] if key is not None and last[0] == key else last[1]
        return Previous([ids.tolist() for ids in call.ids], call.said)

    def follow(self, attribution: Attribution, prompt_ids: list[int],
               responses: list[list[int]], key: str | None = None,
               said: dict[tuple[str, ...], tuple[str, str]] | None = None) -> bool | None:
        """Whether this call extends the attempt's previous one (None: there was none, or
        this is a retry of it under the same idempotency key)."""
        where = self._where(attribution)
        call = _Call([array("i", [*prompt_ids, *r]) for r in responses], said or {})
        with self._lock:
            last = self._last.pop(where, None)
            if last is not None and key is not None and last[0] == key:
                self._last[where] = last
                return None
            if last is not None:
                self.held -= _size(last)
            self._last[where] = (key, call, last[1] if last is not None else _Call([], {}))
            self.held += _size(self._last[where])
            while self.held > self.max_tokens and len(self._last) > 1:
                self.held -= _size(self._last.popitem(last=False)[1])
        if last is None:
            return None
        prompt = array("i", prompt_ids)
        return any(prompt[:len(ids)] == ids for ids in last[1].ids)

    @staticmethod
    def _where(attribution: Attribution) -> tuple[int, str, str]:
        return attribution.project.pk, attribution.rollout_id, attribution.attempt_id


@dataclass
class _Call:
    ids: list[array]
    said: dict[tuple[str, ...], tuple[str, str]]


def _size(entry: tuple[str | None, _Call, _Call]) -> int:
    return sum(len(ids) for call in entry[1:] for ids in call.ids)
