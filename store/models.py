"""The LightningStore's tables. Every write goes through store.services."""

from __future__ import annotations

from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q

from store.ids import new_resources_id, new_rollout_id
from store.jsontext import SpanJSONEncoder
from store.rules import SPAN_ID_BLOCK
from store.statemachine import (
    ATTEMPT_LIVE,
    QUEUED,
    AttemptStatus,
    RolloutStatus,
    WorkerStatus,
)


class Project(models.Model):
    """A tenant: every store object belongs to one project."""

    name = models.SlugField(max_length=100, unique=True)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # The cap on the project's ledger GPU-seconds over the last 24 h (store/rules.py
    # GPU_QUOTA, README "Quotas"): past it, its training steps wait; null: no cap.
    gpu_seconds_per_day = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0)],
        help_text="GPU-seconds per rolling 24 h; empty: no cap")
    # Its share of the workers against other projects (README "Scheduling"): a claim serves the
    # project with the least decayed usage per unit of weight first.
    share_weight = models.FloatField(default=1.0)
    # At most this many of its rollouts claimed and not finished (preparing or running) at
    # once; past it the claim skips the project and its rollouts wait. None: no cap.
    max_concurrent_rollouts = models.PositiveIntegerField(null=True, blank=True)

    def __str__(self) -> str:
        return self.name


class Party(models.Model):
    """A party of the fair share inside a project: the rollouts enqueued under one key (the
    trainer's "trainer/job/<pk>"; "" for those enqueued without one). Holds the party's
    weight within its project and its usage: claims, decayed with the half-life
    SCHEDULER_USAGE_HALF_LIFE_SECONDS from `usage_at` (store.rules.DECAYED). The claim
    statement updates the usage of the parties it claimed from (README "Scheduling")."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="parties",
                                db_index=False)
    key = models.CharField(max_length=200, blank=True)
    weight = models.FloatField(default=1.0)
    usage = models.FloatField(default=0.0)
    usage_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "parties"
        constraints = [
            models.UniqueConstraint(fields=["project", "key"], name="party_uniq")
        ]

    def __str__(self) -> str:
        return f"{self.project_id}/{self.key or '(project)'}"


class ApiKey(models.Model):
    class Role(models.TextChoices):
        RUNNER = "runner"
        ALGORITHM = "algorithm"
        ADMIN = "admin"  # its project's admin
        # The site's operator: everything admin may do, and create projects (README "Keys
        # and roles"); made only from a terminal (`apikey_create NAME --role site_admin`).
        SITE_ADMIN = "site_admin"

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    role = models.CharField(max_length=16, choices=Role.choices)
    # The first characters of the key, stored plain so a key can be found without a scan.
    prefix = models.CharField(max_length=16, unique=True)
    # sha256 of the whole key; keys are 256 random bits, so a fast hash is enough.
    hashed_key = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.project.name}/{self.name} ({self.role}, {self.prefix}...)"


class ResourceSet(models.Model):
    """A resources id (`rs-...` or one the algorithm chose): a name for an immutable history
    of versions. Ids are per project: two projects may use the same one independently."""

    # Internal key only (random; rows from before migration 0005 kept their public id).
    id = models.CharField(primary_key=True, max_length=40, default=new_resources_id)
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="resource_sets")
    resources_id = models.CharField(max_length=40, default=new_resources_id)
    version = models.PositiveIntegerField(default=0, help_text="Latest version number")
    create_time = models.DateTimeField()
    update_time = models.DateTimeField()

    class Meta:
        indexes = [
            # "latest resources" = most recently updated in the project
            models.Index(fields=["project", "-update_time"], name="resourceset_latest"),
        ]
        constraints = [
            models.UniqueConstraint(fields=["project", "resources_id"], name="resourceset_uniq")
        ]

    def __str__(self) -> str:
        return f"{self.resources_id} v{self.version}"


class ResourceVersion(models.Model):
    resource_set = models.ForeignKey(ResourceSet, on_delete=models.CASCADE, related_name="versions")
    version = models.PositiveIntegerField()
    resources = models.JSONField()
    created_at = models.DateTimeField()
    # Retention never deletes a version marked keep (e.g. the best checkpoint).
    keep = models.BooleanField(default=False)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["resource_set", "version"], name="resourceversion_uniq")
        ]

    def __str__(self) -> str:
        return f"{self.resource_set.resources_id} v{self.version}"


class Rollout(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=new_rollout_id)
    # db_index=False here and below: a composite index that leads with the column serves it.
    project = models.ForeignKey(
        Project, on_delete=models.CASCADE, related_name="rollouts", db_index=False
    )
    input = models.JSONField(null=True)
    mode = models.CharField(max_length=8, null=True, blank=True)
    resources_id = models.CharField(max_length=40, null=True, blank=True)
    # The version of `resources_id` pinned when the rollout was enqueued (retention keeps it).
    resources_version = models.PositiveIntegerField(null=True, blank=True)
    status = models.CharField(
        max_length=16, choices=RolloutStatus.choices, default=RolloutStatus.QUEUING
    )
    config = models.JSONField(default=dict)
    metadata = models.JSONField(default=dict, blank=True)
    start_time = models.DateTimeField()
    end_time = models.DateTimeField(null=True, blank=True)
    # Claim order: priority first (higher wins), then FIFO by enqueue time.
    priority = models.IntegerField(default=0)
    enqueue_time = models.DateTimeField(null=True, blank=True)
    # Past this instant a rollout still waiting in the queue fails (None: wait forever).
    queue_deadline = models.DateTimeField(null=True, blank=True)
    queue_timeout_seconds = models.FloatField(null=True, blank=True)
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)
    latest_attempt = models.ForeignKey(
        "Attempt", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    attempt_count = models.PositiveIntegerField(default=0)
    # How the rollout is delivered: None (runners dequeue it) or "celery" (a rollout task is sent
    # for it, and sent again by the reconciliation sweep while it waits in the queue).
    dispatch = models.CharField(max_length=16, null=True, blank=True)
    # What runs it under that dispatch (the agent's dotted path).
    dispatch_target = models.CharField(max_length=300, null=True, blank=True)
    # When its message was last sent, and how many times it was sent.
    dispatched_at = models.DateTimeField(null=True, blank=True)
    dispatch_count = models.PositiveIntegerField(default=0)
    # AGL's span sequence counter: one per rollout, shared by its attempts.
    next_span_sequence_id = models.PositiveIntegerField(default=1)
    # What keeps an id `spans/next` handed out with an asynchronous commit from being handed
    # out again after a crash (rules.SPAN_BASE, SPAN_IDS_DURABLE): ids below
    # `span_ids_reserved` may be handed out asynchronously (it only moves in a synchronous
    # commit), and `span_epoch` is the span epoch (a new one after every crash recovery:
    # store/services/_rows.py server_epoch) in which the counter last moved (set at enqueue;
    # None on SQLite, or unknown: the next reservation commits synchronously).
    # (No CHECK >= 0: Postgres checks every CHECK of a table on each update of a row.)
    span_ids_reserved = models.IntegerField(default=1 + SPAN_ID_BLOCK)
    span_epoch = models.DateTimeField(null=True, blank=True)
    # The batch an algorithm waits on (a training step's rollouts); set at enqueue only, by
    # the algorithm's own services, never from a client's request.
    group = models.ForeignKey(
        "RolloutGroup", null=True, blank=True, on_delete=models.SET_NULL,
        related_name="rollouts", db_index=False,
    )
    # Its party of the fair share (set at enqueue; the claim picks among parties).
    party = models.ForeignKey(Party, null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="rollouts", db_index=False)

    class Meta:
        indexes = [
            # reconciliation: queued rollouts delivered by a message, oldest send first
            models.Index(
                fields=["dispatched_at"],
                name="rollout_dispatch_due",
                condition=Q(status__in=QUEUED, dispatch__isnull=False),
            ),
            # dequeue: oldest queued rollout of a project, highest priority first
            models.Index(
                "project",
                models.F("priority").desc(),
                "enqueue_time",
                name="rollout_claim_order",
                condition=Q(status__in=QUEUED),
            ),
            # the fair claim: a party's queued rollouts, highest priority then oldest first
            models.Index(
                "party",
                models.F("priority").desc(),
                "enqueue_time",
                name="rollout_party_claim_order",
                condition=Q(status__in=QUEUED),
            ),
            # watchdog: queued rollouts whose waiting time is bounded
            models.Index(
                fields=["queue_deadline"],
                name="rollout_queue_deadline",
                condition=Q(status__in=QUEUED, queue_deadline__isnull=False),
            ),
            models.Index(fields=["project", "status"], name="rollout_project_status"),
            models.Index(fields=["project", "start_time"], name="rollout_project_start"),
            models.Index(fields=["resources_id", "resources_version"], name="rollout_resources"),
            models.Index(fields=["group"], name="rollout_group",
                         condition=Q(group__isnull=False)),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["project", "idempotency_key"],
                name="rollout_idempotency_key",
                condition=Q(idempotency_key__isnull=False),
            )
        ]

    def __str__(self) -> str:
        return self.id


class RolloutGroup(models.Model):
    """A batch of rollouts an algorithm waits on (a training step's rollouts), as data: how
    many it holds and how many of them are terminal. Both counts change in the transaction
    that enqueues a member or makes one terminal (or reopens it), so they are never behind
    the rollouts. Reaching `finished == total` writes a `GroupCompletion` in that same
    transaction: the durable event its owner consumes."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="groups")
    # Chosen by the creator, unique per project (the trainer: "trainer/step/<pk>/r<round>").
    key = models.CharField(max_length=200)
    # Who consumes its completions ("trainer").
    owner = models.CharField(max_length=40)
    total = models.PositiveIntegerField(default=0)
    finished = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    # When `finished` last reached `total`; None while members are open.
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["project", "key"], name="rolloutgroup_key_uniq")
        ]

    def __str__(self) -> str:
        return f"{self.key} ({self.finished}/{self.total})"


class GroupCompletion(models.Model):
    """A group's members all became terminal: an event for the group's owner, consumed once
    by deleting it (a compare-and-swap: of two takers, one deletes the row, the other finds
    it gone) in the transaction that reacts to it, so a reaction that fails or a process
    that dies before its commit leaves the event to the next consumer. Nothing reads an event
    after its reaction (the group keeps `completed_at`), so consumed events leave no rows."""

    group = models.ForeignKey(RolloutGroup, on_delete=models.CASCADE, related_name="completions")
    owner = models.CharField(max_length=40)
    created_at = models.DateTimeField()

    class Meta:
        indexes = [
            # consumers: an owner's events, oldest first
            models.Index(fields=["owner", "created_at"], name="groupcompletion_owner"),
        ]

    def __str__(self) -> str:
        return f"group {self.group_id} completed at {self.created_at}"


class Attempt(models.Model):
    # attempt ids (`at-` + 8 hex) are too short to be unique across millions of attempts, so
    # they are unique per rollout, as AGL addresses them: /rollouts/{rid}/attempts/{aid}.
    rollout = models.ForeignKey(
        Rollout, on_delete=models.CASCADE, related_name="attempts", db_index=False
    )
    attempt_id = models.CharField(max_length=40)
    sequence_id = models.PositiveIntegerField()
    status = models.CharField(
        max_length=16, choices=AttemptStatus.choices, default=AttemptStatus.PREPARING
    )
    worker_id = models.CharField(max_length=200, null=True, blank=True)
    start_time = models.DateTimeField()
    end_time = models.DateTimeField(null=True, blank=True)
    last_heartbeat_time = models.DateTimeField(null=True, blank=True)
    metadata = models.JSONField(default=dict, blank=True)
    # When the watchdog must look at this attempt: the earlier of the timeout and the
    # unresponsive limit; None when its rollout's config sets neither.
    deadline = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["rollout", "attempt_id"], name="attempt_id_uniq"),
            models.UniqueConstraint(fields=["rollout", "sequence_id"], name="attempt_seq_uniq"),
        ]
        indexes = [
            # watchdog: live attempts past their deadline, oldest first
            models.Index(
                fields=["deadline"],
                name="attempt_live_deadline",
                condition=Q(status__in=ATTEMPT_LIVE, deadline__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.rollout_id}/{self.attempt_id}"


class Span(models.Model):
    # Spans are the hot append path: no index of their own on either key (the composite
    # indexes below lead with them), and no database constraint on the rollout, which is
    # always the attempt's rollout (the services copy it) and whose attempt is checked.
    rollout = models.ForeignKey(
        Rollout, on_delete=models.CASCADE, related_name="spans", db_index=False,
        db_constraint=False,
    )
    attempt = models.ForeignKey(
        Attempt, on_delete=models.CASCADE, related_name="spans", db_index=False
    )
    sequence_id = models.IntegerField()
    trace_id = models.CharField(max_length=64)
    span_id = models.CharField(max_length=32)
    parent_id = models.CharField(max_length=32, null=True, blank=True)
    name = models.CharField(max_length=500)
    # JSON as store/jsontext.py writes it on every path (NaN and infinities as null)
    status = models.JSONField(default=dict, encoder=SpanJSONEncoder)
    attributes = models.JSONField(default=dict, encoder=SpanJSONEncoder)
    events = models.JSONField(default=list, encoder=SpanJSONEncoder)
    links = models.JSONField(default=list, encoder=SpanJSONEncoder)
    # OpenTelemetry times as epoch seconds, as AGL sends them.
    start_time = models.FloatField(null=True)
    end_time = models.FloatField(null=True)
    context = models.JSONField(null=True, encoder=SpanJSONEncoder)
    parent = models.JSONField(null=True, encoder=SpanJSONEncoder)
    resource = models.JSONField(default=dict, encoder=SpanJSONEncoder)
    # Unknown fields a client sent; kept and returned as AGL does.
    extra = models.JSONField(default=dict, encoder=SpanJSONEncoder)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["attempt", "span_id"], name="span_attempt_span_uniq")
        ]
        indexes = [
            models.Index(fields=["rollout", "sequence_id"], name="span_rollout_seq"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.span_id})"


class Worker(models.Model):
    project = models.ForeignKey(
        Project, on_delete=models.CASCADE, related_name="workers", db_index=False
    )
    worker_id = models.CharField(max_length=200)
    status = models.CharField(
        max_length=16, choices=WorkerStatus.choices, default=WorkerStatus.UNKNOWN
    )
    heartbeat_stats = models.JSONField(null=True, blank=True)
    last_heartbeat_time = models.DateTimeField(null=True, blank=True)
    last_dequeue_time = models.DateTimeField(null=True, blank=True)
    last_busy_time = models.DateTimeField(null=True, blank=True)
    last_idle_time = models.DateTimeField(null=True, blank=True)
    current_rollout_id = models.CharField(max_length=40, null=True, blank=True)
    current_attempt_id = models.CharField(max_length=40, null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["project", "worker_id"], name="worker_uniq")
        ]

    def __str__(self) -> str:
        return self.worker_id


class UsageEntry(models.Model):
    """The cost ledger: what one attempt or one training step used, append-only. Written in the
    transaction that gives the verdict (a runner's final report on an attempt; a step's finish),
    so the ledger and the verdicts cannot drift; never updated (README "Cost")."""

    class Kind(models.TextChoices):
        ATTEMPT = "attempt"
        STEP = "step"

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="usage",
                                db_index=False)
    kind = models.CharField(max_length=8, choices=Kind.choices)
    # The attempt's rollout and attempt ids (kind "attempt"); kept as values: a ledger row
    # outlives nothing it describes, and needs no lock on them.
    rollout_id = models.CharField(max_length=40, null=True, blank=True)
    attempt_id = models.CharField(max_length=40, null=True, blank=True)
    # The rollout group it belongs to (a training step's rollouts, or the step itself): how a
    # job's totals are found (trainer.selectors.job_usage).
    group_id = models.BigIntegerField(null=True, blank=True)
    # CPU time of the process that ran it (getrusage), not wall time.
    cpu_seconds = models.FloatField(default=0.0)
    # Wall time x CUDA devices held; gpu_type: the device's name (priced by it).
    gpu_seconds = models.FloatField(default=0.0)
    gpu_type = models.CharField(max_length=100, blank=True, default="")
    # Tokens the model gateway generated for the attempt's calls (its spans).
    tokens = models.BigIntegerField(default=0)
    # The price list (settings COST_*) applied when the row was written.
    cost = models.FloatField(default=0.0)
    created_at = models.DateTimeField()

    class Meta:
        indexes = [
            # per-project totals and listings, newest first
            models.Index(fields=["project", "created_at"], name="usage_project_time"),
            # a project's GPU-seconds over the quota's window (store.selectors.gpu_quotas):
            # only the rows that used a GPU (training steps), not every attempt's
            models.Index(fields=["project", "created_at"], name="usage_project_gpu_time",
                         condition=Q(gpu_seconds__gt=0)),
            # per-job totals: the rows of the job's groups
            models.Index(fields=["group_id"], name="usage_group",
                         condition=Q(group_id__isnull=False)),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.rollout_id or self.group_id}: {self.cost:.6f}"
