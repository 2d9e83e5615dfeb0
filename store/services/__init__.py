"""Every write to the store. Keyword-only, typed, one short transaction each."""

from store.services._ledger import Usage
from store.services._rows import KEY_LIVE_SQL, KeyNotLive, LiveKey, require_key_live
from store.services.attempts import (
    AttemptUpdate,
    attempt_finish,
    attempt_update,
    attempt_update_many,
)
from store.services.dispatch import (
    Dispatch,
    rollout_dispatch_due,
    rollout_dispatch_set,
    rollout_dispatch_unpublished,
)
from store.services.groups import group_completions_take, group_create
from store.services.ledger import usage_record_step
from store.services.projects import (
    api_key_authenticate,
    api_key_create,
    project_create,
    project_first_start,
    project_quota_set,
)
from store.services.resources import (
    resources_add,
    resources_retain,
    resources_set_keep,
    resources_update,
)
from store.services.rollouts import (
    RolloutSpec,
    attempt_start,
    rollout_claim,
    rollout_claim_next,
    rollout_dequeue,
    rollout_dequeue_many,
    rollout_enqueue,
    rollout_enqueue_many,
    rollout_start,
    rollout_update,
)
from store.services.shares import UNCHANGED, Share, share_set
from store.services.spans import (
    SpansExported,
    SpansIngested,
    span_add,
    span_add_lean,
    span_next_sequence_id,
    span_next_sequence_statement,
    span_transaction,
    spans_add,
    spans_export,
    spans_ingest,
)
from store.services.workers import worker_update

__all__ = [
    "AttemptUpdate",
    "Dispatch",
    "KEY_LIVE_SQL",
    "KeyNotLive",
    "LiveKey",
    "RolloutSpec",
    "Usage",
    "api_key_authenticate",
    "api_key_create",
    "attempt_finish",
    "attempt_start",
    "attempt_update",
    "attempt_update_many",
    "group_completions_take",
    "group_create",
    "project_create",
    "project_first_start",
    "project_quota_set",
    "require_key_live",
    "resources_add",
    "resources_retain",
    "resources_set_keep",
    "resources_update",
    "rollout_claim",
    "rollout_claim_next",
    "Share",
    "share_set",
    "UNCHANGED",
    "rollout_dequeue",
    "rollout_dispatch_due",
    "rollout_dispatch_set",
    "rollout_dispatch_unpublished",
    "rollout_dequeue_many",
    "rollout_enqueue",
    "rollout_enqueue_many",
    "rollout_start",
    "rollout_update",
    "span_add",
    "span_add_lean",
    "span_next_sequence_id",
    "span_next_sequence_statement",
    "spans_export",
    "spans_ingest",
    "span_transaction",
    "SpansExported",
    "SpansIngested",
    "spans_add",
    "usage_record_step",
    "worker_update",
]
