"""The fair share's settings (README "Scheduling"): a project's weight and its cap on
concurrent rollouts, a party's (job's) weight inside its project. The claim reads them
(store/services/_claim.py); nothing else changes with them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from django.db import transaction

from store.errors import InvalidInput
from store.models import Party, Project
from store.services.projects import UNCHANGED  # an argument not given (a cap unset is None)

MIN_WEIGHT, MAX_WEIGHT = 1e-6, 1e6


@dataclass(frozen=True)
class Share:
    """What `share_set` left: the project's weight and cap, the party's weight if one was
    named."""

    project_weight: float
    max_concurrent_rollouts: int | None
    party: str | None
    party_weight: float | None


def _weight(value: object, field: str) -> float:
    if (not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value)
            or not MIN_WEIGHT <= value <= MAX_WEIGHT):
        raise InvalidInput(field, f"must be a number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}]")
    return float(value)


def share_set(*, project: Project, weight: float | None = None, party: str | None = None,
              party_weight: float | None = None,
              max_concurrent_rollouts: object = UNCHANGED) -> Share:
    """Set what is given: the project's `weight`, its `max_concurrent_rollouts` (None: no
    cap), the weight `party_weight` of its party `party` ("", the default: its rollouts
    enqueued without a job; created if new: a job's party may be weighted before its first
    rollout). Compare-and-swap free: each is one column written whole."""
    fields = {}
    if weight is not None:
        fields["share_weight"] = _weight(weight, "weight")
    if max_concurrent_rollouts is not UNCHANGED:
        cap = max_concurrent_rollouts
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool)
                                or not 0 <= cap <= 2**31 - 1):
            raise InvalidInput("max_concurrent_rollouts", "must be an integer >= 0, or null")
        fields["max_concurrent_rollouts"] = cap
    if party_weight is not None and party is None:
        party = ""  # the project's own party: its rollouts enqueued without a job
    if party is not None and len(party) > Party._meta.get_field("key").max_length:
        raise InvalidInput("party", "must be at most 200 characters")
    party_weight = None if party_weight is None else _weight(party_weight, "party_weight")
    with transaction.atomic():
        if fields:
            Project.objects.filter(pk=project.pk).update(**fields)
        if party is not None:
            row, _ = Party.objects.get_or_create(project=project, key=party)
            if party_weight is not None:
                Party.objects.filter(pk=row.pk).update(weight=party_weight)
        project.refresh_from_db(fields=["share_weight", "max_concurrent_rollouts"])
        current = (Party.objects.filter(project=project, key=party)
                   .values_list("weight", flat=True).first() if party is not None else None)
    return Share(project.share_weight, project.max_concurrent_rollouts, party, current)
