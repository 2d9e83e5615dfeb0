"""The cost ledger's rules (README "Cost"), each in Python and, where the verdict statement
applies it, in SQL beside it; tests/test_ledger.py holds the two to the same answers.

- An attempt gets one ledger row, in the transaction that moves it to a runner's final
  verdict (succeeded or failed), from whatever status it had: the verdict statement
  (_verdict.py) and the full path (attempts.py) both write it.
- Its tokens are those the model gateway generated for its calls: the completion tokens of
  the attempt's spans that the gateway wrote (`gen_ai.system` = "lightning").
- cost = cpu_seconds x COST_PER_CPU_SECOND + gpu_seconds x the GPU price of its device type
  + tokens x COST_PER_1K_TOKENS / 1000, with the prices of the moment it is written."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db.models import CharField, F, Func
from django.db.models.fields.json import KeyTransform

from store.errors import InvalidInput
from store.models import Attempt, Project, Span, UsageEntry

GATEWAY_SYSTEM = "lightning"  # trainer/llm/calls.py writes it as gen_ai.system
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"


@dataclass(frozen=True)
class Usage:
    """What a runner measured for one attempt (or the trainer for one step)."""

    cpu_seconds: float = 0.0
    gpu_seconds: float = 0.0
    gpu_type: str = ""

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "gpu_seconds"):
            value = getattr(self, name)
            if (not isinstance(value, int | float) or isinstance(value, bool)
                    or not math.isfinite(value) or value < 0):
                raise InvalidInput(f"usage.{name}", "must be a finite number >= 0")


def gpu_price(gpu_type: str) -> float:
    """The price of a GPU-second on `gpu_type`: the first COST_PER_GPU_SECOND entry whose name
    is part of the device's name (case-insensitive), else its "*" entry, else 0."""
    prices = settings.COST_PER_GPU_SECOND
    name = (gpu_type or "").lower()
    for key, price in prices.items():
        if key != "*" and key.lower() in name:
            return price
    return prices.get("*", 0.0)


def fixed_cost(usage: Usage) -> float:
    """The part of the cost known before the tokens are counted."""
    return usage.cpu_seconds * settings.COST_PER_CPU_SECOND + (
        usage.gpu_seconds * gpu_price(usage.gpu_type) if usage.gpu_seconds else 0.0)


def cost_of(usage: Usage, tokens: int) -> float:
    return fixed_cost(usage) + tokens * settings.COST_PER_1K_TOKENS / 1000


def cost_sql(tokens: str, fixed: str = "%s") -> str:
    """cost_of in SQL, `tokens` and `fixed` (fixed_cost; a parameter by default) SQL
    expressions; then a parameter: COST_PER_1K_TOKENS (the same operations in the same
    order as cost_of, so the same float)."""
    return f"({fixed}::float8 + ({tokens})::float8 * %s::float8 / 1000)"


def gateway_tokens(attempt_pks: Iterable[int]) -> dict[int, int]:
    """Tokens the gateway generated per attempt (by attempt pk): a whole-number count from
    each of its spans, truncated, anything else ignored."""
    # The key lookup (not an annotation compared to a string: on SQLite that compares with
    # JSON_EXTRACT of the bare string, malformed JSON).
    rows = (Span.objects.filter(attempt_id__in=list(attempt_pks),
                                **{"attributes__gen_ai.system": GATEWAY_SYSTEM})
            .annotate(n=KeyTransform(COMPLETION_TOKENS, "attributes"),
                      kind=_JsonType(COMPLETION_TOKENS))
            .values_list("attempt_id", "n", "kind"))
    tokens: dict[int, int] = {}
    for attempt_pk, n, kind in rows:
        if kind in _JSON_NUMBER:  # SQLite hands a string of digits back as a number
            tokens[attempt_pk] = tokens.get(attempt_pk, 0) + int(n)
    return tokens


# The type names of a JSON number: Postgres' jsonb_typeof, SQLite's json_type.
_JSON_NUMBER = {"number", "integer", "real"}


class _JsonType(Func):
    """The JSON type of the spans' attribute `key` (a key with dots in its name)."""

    output_field = CharField()

    def __init__(self, key: str) -> None:
        super().__init__(F("attributes"))
        self.key = key

    def as_postgresql(self, compiler, connection, **extra):
        sql, params = compiler.compile(self.source_expressions[0])
        return f"jsonb_typeof({sql} -> %s)", [*params, self.key]

    def as_sqlite(self, compiler, connection, **extra):
        sql, params = compiler.compile(self.source_expressions[0])
        return f"json_type({sql}, %s)", [*params, f'$."{self.key}"']


def gateway_tokens_sql(attempt_pk: str) -> str:
    """gateway_tokens in SQL for the attempt whose pk is the expression `attempt_pk` (served
    by the span table's unique (attempt, span_id) index)."""
    n = f"s.attributes->'{COMPLETION_TOKENS}'"
    return (f"(SELECT COALESCE(sum(trunc(({n})::text::numeric)), 0)::bigint FROM store_span s "
            f"WHERE s.attempt_id = {attempt_pk} AND s.attributes->>'gen_ai.system' = "
            f"'{GATEWAY_SYSTEM}' AND jsonb_typeof({n}) = 'number')")


def attempt_rows(project: Project | int, verdicts: Sequence[tuple[Attempt, Usage | None]],
                 now: datetime) -> list[UsageEntry]:
    """The ledger rows of attempts just given their final verdict (the full path; written by
    the caller in its transaction)."""
    tokens = gateway_tokens(a.pk for a, _ in verdicts)
    rows = []
    for attempt, usage in verdicts:
        usage = usage or Usage()
        n = tokens.get(attempt.pk, 0)
        rows.append(UsageEntry(
            project_id=getattr(project, "pk", project), kind=UsageEntry.Kind.ATTEMPT,
            rollout_id=attempt.rollout_id, attempt_id=attempt.attempt_id,
            group_id=attempt.rollout.group_id, cpu_seconds=usage.cpu_seconds,
            gpu_seconds=usage.gpu_seconds, gpu_type=usage.gpu_type, tokens=n,
            cost=cost_of(usage, n), created_at=now))
    return rows


class LedgerWrite:
    """The full path's ledger rows as one of `write_together`'s writes (_bulk.py), so they
    travel in the verdict's round trip on Postgres: one INSERT ... SELECT over the verdicts'
    values, the tokens counted by gateway_tokens_sql and the cost by cost_sql. Elsewhere
    (`run_portable`) the Python rules above write the same rows."""

    def __init__(self, project: Project | int,
                 verdicts: Sequence[tuple[Attempt, Usage | None]], now: datetime) -> None:
        self.project_id = getattr(project, "pk", project)
        self.rows = [(attempt, usage or Usage()) for attempt, usage in verdicts]
        self.now = now

    def run_portable(self) -> None:
        UsageEntry.objects.bulk_create(attempt_rows(self.project_id, self.rows, self.now))

    def statement(self) -> tuple[str, list]:
        values, params = [], []
        for attempt, usage in self.rows:
            values.append("(%s::bigint, %s::varchar, %s::varchar, %s::bigint, %s::float8, "
                          "%s::float8, %s::varchar, %s::float8)")
            params += [attempt.pk, attempt.rollout_id, attempt.attempt_id,
                       attempt.rollout.group_id, usage.cpu_seconds, usage.gpu_seconds,
                       usage.gpu_type, fixed_cost(usage)]
        sql = ("INSERT INTO store_usageentry (project_id, kind, rollout_id, attempt_id, group_id, "
               "cpu_seconds, gpu_seconds, gpu_type, tokens, cost, created_at) "
               f"SELECT %s::bigint, 'attempt', v.rid, v.aid, v.gid, v.cpu, v.gpu, v.gtype, t.n, "
               f"{cost_sql('t.n', 'v.fixed')}, %s::timestamptz "
               f"FROM (VALUES {', '.join(values)}) "
               "AS v (pk, rid, aid, gid, cpu, gpu, gtype, fixed), "
               f"LATERAL (SELECT {gateway_tokens_sql('v.pk')} AS n) t")
        # In the text's order: the SELECT list's, then the VALUES'.
        return sql, [self.project_id, settings.COST_PER_1K_TOKENS, self.now, *params]
