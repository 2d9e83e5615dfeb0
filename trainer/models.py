"""Training jobs and their steps: every arrow of the training loop is a row change here
(DESIGN.md "The training loop as data"). Every write goes through trainer.services."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from store.models import Project


class JobStatus(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    # stopped on purpose (Ctrl+C on `train`): nothing advances it until train_resume
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


JOB_TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})


class StepStatus(models.TextChoices):
    # rollouts enqueued, runners executing them against `resources_version`
    ROLLING = "rolling"
    # every rollout terminal (or the deadline passed): a train-step task has been sent
    READY = "ready"
    # a training worker claimed the step and holds it until `lease_until`
    TRAINING = "training"
    # produced `produced_version` and planned step n+1
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


STEP_OPEN = (StepStatus.ROLLING, StepStatus.READY, StepStatus.TRAINING)


class TrainingJob(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="training_jobs")
    name = models.CharField(max_length=200, blank=True)
    agent = models.CharField(max_length=300, help_text="Dotted path of the agent")
    algorithm = models.CharField(max_length=300, help_text="Built-in name or dotted path")
    config = models.JSONField(default=dict, blank=True)
    train_dataset = models.JSONField(default=list, blank=True)
    val_dataset = models.JSONField(default=list, blank=True)
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.PENDING)
    error = models.TextField(blank=True)
    # The resources id whose versions are this job's checkpoints (version k = checkpoint k-1).
    resources_id = models.CharField(max_length=40, blank=True)
    best_version = models.PositiveIntegerField(null=True, blank=True)
    best_metric = models.FloatField(null=True, blank=True)
    # Asynchronous jobs consuming groups: the groups (and their rollouts) planned but not
    # trained on when the last training step was done (config `spare_groups`: the job plans
    # that many beyond what its steps train on); their open rollouts were cancelled.
    surplus_groups = models.PositiveIntegerField(default=0)
    surplus_rollouts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["project", "-created_at"], name="job_project_created")]

    def __str__(self) -> str:
        return f"job {self.pk} {self.name}".strip()

    @property
    def total_steps(self) -> int:
        return int(self.config.get("steps", 0))


class TrainingStep(models.Model):
    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="steps")
    n = models.PositiveIntegerField(help_text="Step index, from 0")
    status = models.CharField(
        max_length=16, choices=StepStatus.choices, default=StepStatus.ROLLING
    )
    # The checkpoint version this step's rollouts ran against, and the one it produced.
    resources_version = models.PositiveIntegerField()
    produced_version = models.PositiveIntegerField(null=True, blank=True)
    # The step's rollouts are the members of `group` (store.models.RolloutGroup, key
    # "trainer/step/<pk>/r<round>"); a step planned again (a retry, a resumed job) gets a new
    # round and a new group. The counts are what the plan asked for.
    round = models.PositiveIntegerField(default=0)
    group = models.ForeignKey("store.RolloutGroup", null=True, blank=True,
                              on_delete=models.SET_NULL, related_name="training_steps")
    rollout_count = models.PositiveIntegerField(default=0)
    val_rollout_count = models.PositiveIntegerField(default=0)
    # Past this instant the step trains on what finished and cancels the rest.
    deadline = models.DateTimeField(null=True, blank=True)
    # Tries of the train-step task (a try that crashed counts too), bounded by max_attempts.
    attempts = models.PositiveIntegerField(default=0)
    # Asynchronous jobs (config max_staleness > 0): times the step's group was planned again
    # because a sample aged past the bound, and how many rollouts those groups held.
    stale_replans = models.PositiveIntegerField(default=0)
    stale_rollouts = models.PositiveIntegerField(default=0)
    # Asynchronous jobs consuming groups (config consume "groups"): the ids of the train
    # rollouts this step trained on, wherever planned (written when it is done).
    trained = models.JSONField(default=list, blank=True)
    # A claimed step belongs to its worker until then; after it the sweep sends it again.
    lease_until = models.DateTimeField(null=True, blank=True)
    worker = models.CharField(max_length=200, blank=True)
    device = models.CharField(max_length=32, blank=True)
    metrics = models.JSONField(default=dict, blank=True)
    # Instants (ISO strings) of each arrow: planned, ready, train_started, done; and seconds.
    timings = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    sent_at = models.DateTimeField(null=True, blank=True, help_text="Last train task sent")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["job", "n"], name="trainingstep_job_n_uniq"),
        ]
        indexes = [
            # the trainer sweep: open steps (rolling past deadline, ready unsent, lease expired)
            models.Index(
                fields=["status", "updated_at"],
                name="trainingstep_open",
                condition=Q(status__in=["rolling", "ready", "training"]),
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} step {self.n}"

    def group_keys(self) -> list[str]:
        """Keys of the rollout groups of every round of the step, oldest first."""
        return [group_key(self.pk, r) for r in range(self.round + 1)]


# The owner of the trainer's rollout groups (store.models.RolloutGroup.owner).
GROUP_OWNER = "trainer"


def group_key(step_id: int, round: int) -> str:
    """The key of the rollout group a step's round of rollouts belongs to. A group key is no
    idempotency key: only the trainer's services create groups, so no client's rollout can
    join one."""
    return f"trainer/step/{step_id}/r{round}"


class GangMember(models.Model):
    """One training worker of the gang that runs a multi-node step's try (job config `nodes`,
    trainer/gang.py): the rendezvous is these rows. A worker joins the try it gathers for
    (`attempt`: the step's `attempts` + 1) under a node rank; node 0's worker serves the
    TCPStore every rank meets at and writes its address here. When `nodes` rows are there the
    step is claimed for them all at once; rows of a try that started stay (which workers ran
    it), a member that gave up gathering deletes its row."""

    step = models.ForeignKey(TrainingStep, on_delete=models.CASCADE,
                             related_name="gang_members")
    attempt = models.PositiveIntegerField()
    node_rank = models.PositiveIntegerField()
    worker = models.CharField(max_length=200)
    host = models.CharField(max_length=200)
    pid = models.PositiveIntegerField()
    # node 0 only: where every rank meets (its worker's TCPStore) and the backend it chose
    master_addr = models.CharField(max_length=200, blank=True)
    master_port = models.PositiveIntegerField(null=True, blank=True)
    backend = models.CharField(max_length=8, blank=True)
    joined_at = models.DateTimeField()
    # the member's own heartbeat while it gathers and trains; a silent peer fails the try
    seen_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["step", "attempt", "node_rank"],
                                    name="gangmember_step_try_rank_uniq"),
            models.UniqueConstraint(fields=["step", "attempt", "worker"],
                                    name="gangmember_step_try_worker_uniq"),
        ]

    def __str__(self) -> str:
        return f"step {self.step_id} try {self.attempt} node {self.node_rank}: {self.worker}"
