from __future__ import annotations

import json
from datetime import UTC, datetime

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from store import selectors, services
from store.errors import StoreError
from store.models import (
    ApiKey,
    Attempt,
    Party,
    Project,
    ResourceSet,
    ResourceVersion,
    Rollout,
    RolloutGroup,
    Span,
    UsageEntry,
    Worker,
)
from store.rewards import rollout_rewards
from store.spantree import span_tree
from store.statemachine import RolloutStatus

# Spans drawn on an attempt's page; the span list has them all.
SPAN_TREE_LIMIT = 500


class ApiKeyInline(admin.TabularInline):
    model = ApiKey
    extra = 0
    fields = ("name", "role", "prefix", "created_at", "last_used_at", "revoked_at")
    readonly_fields = ("prefix", "created_at", "last_used_at")
    can_delete = False

    def has_add_permission(self, request, obj=None) -> bool:
        return False  # keys are made with the action below, which shows the key once


class PartyInline(admin.TabularInline):
    """The fair share's parties (README "Scheduling"): weights are edited here; usage is the
    claim's own bookkeeping."""

    model = Party
    extra = 0
    fields = ("key", "weight", "usage", "usage_at")
    readonly_fields = ("usage", "usage_at")
    can_delete = False


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ("name", "share_weight", "max_concurrent_rollouts", "gpu_seconds_per_day",
                    "created_at")
    search_fields = ("name",)
    readonly_fields = ("usage", "gpu_quota")

    @admin.display(description="Cost (ledger totals)")
    def usage(self, obj: Project) -> str:
        return selectors.usage_totals(project=obj).describe() if obj.pk else "-"

    @admin.display(description="GPU quota (last 24 h)")
    def gpu_quota(self, obj: Project) -> str:
        quota = selectors.gpu_quotas(project_ids=[obj.pk]).get(obj.pk) if obj.pk else None
        return quota.describe() if quota is not None else "no cap"

    inlines = [ApiKeyInline, PartyInline]
    actions = ["make_runner_key", "make_algorithm_key", "make_admin_key"]

    def _make_key(self, request, queryset, role: str) -> TemplateResponse:
        """The new keys are shown on this answer only: a message would keep them in the
        messages cookie (signed, not encrypted) until the next page."""
        made = [(project, services.api_key_create(project=project, role=role)[1])
                for project in queryset]
        context = {**self.admin_site.each_context(request), "title": f"New {role} keys",
                   "role": role, "made": made, "opts": self.model._meta}
        response = TemplateResponse(request, "admin/store/project/new_keys.html", context)
        response["Cache-Control"] = "no-store"
        return response

    @admin.action(description="Create a runner key (shown once)")
    def make_runner_key(self, request, queryset):
        return self._make_key(request, queryset, ApiKey.Role.RUNNER)

    @admin.action(description="Create an algorithm key (shown once)")
    def make_algorithm_key(self, request, queryset):
        return self._make_key(request, queryset, ApiKey.Role.ALGORITHM)

    @admin.action(description="Create an admin key (shown once)")
    def make_admin_key(self, request, queryset):
        return self._make_key(request, queryset, ApiKey.Role.ADMIN)


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("prefix", "project", "name", "role", "created_at", "last_used_at", "revoked_at")
    list_filter = ("role", "project")
    readonly_fields = ("project", "prefix", "hashed_key", "created_at", "last_used_at")

    def has_add_permission(self, request) -> bool:
        return False


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows other processes write: shown, never edited here (a saved form would bypass the
    status machine, the hooks and the wake-ups). State changes go through actions that call
    the services."""

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


def _seconds(start, end) -> str:
    if start is None:
        return "-"
    seconds = ((end or timezone.now()) - start).total_seconds()
    text = f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
    return text if end else f"{text} (running)"


def _error_block(attempt: Attempt | None) -> str:
    error = (attempt.metadata or {}).get("error") if attempt else None
    if not error:
        return "-"
    return format_html('<pre class="lightning-error" style="white-space: pre-wrap">{}</pre>',
                       str(error))


class AttemptInline(admin.TabularInline):
    model = Attempt
    extra = 0
    fields = ("attempt_link", "sequence_id", "status", "worker_id", "start_time", "end_time",
              "duration", "last_heartbeat_time")
    readonly_fields = fields
    can_delete = False
    ordering = ("sequence_id",)

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(description="attempt (spans)")
    def attempt_link(self, obj: Attempt) -> str:
        url = reverse("admin:store_attempt_change", args=[obj.pk])
        return format_html('<a href="{}">{}</a>', url, obj.attempt_id)

    @admin.display(description="duration")
    def duration(self, obj: Attempt) -> str:
        return _seconds(obj.start_time, obj.end_time)


class AgentFilter(admin.SimpleListFilter):
    title, parameter_name = "agent", "agent"

    def lookups(self, request, model_admin):
        agents = (Rollout.objects.exclude(dispatch_target=None).order_by()
                  .values_list("dispatch_target", flat=True).distinct()[:50])
        return [(a, a) for a in sorted(agents)]

    def queryset(self, request, queryset):
        return queryset.filter(dispatch_target=self.value()) if self.value() else queryset


class JobFilter(admin.SimpleListFilter):
    """Rollouts a training job planned (the trainer writes `trainer.job` into metadata)."""

    title, parameter_name = "training job", "job"

    def lookups(self, request, model_admin):
        recent = (Rollout.objects.filter(metadata__has_key="trainer.job").order_by("-start_time")
                  .values_list("metadata__trainer.job", flat=True)[:2000])
        jobs = sorted({j for j in recent if j is not None}, reverse=True)[:20]
        return [(str(j), f"job {j}") for j in jobs]

    def queryset(self, request, queryset):
        if not (self.value() or "").isdigit():
            return queryset
        return queryset.filter(**{"metadata__trainer.job": int(self.value())})


class RolloutChangeList(ChangeList):
    def get_results(self, request) -> None:
        super().get_results(request)
        # One query for the page's rewards, not one per row.
        rewards = rollout_rewards(rollout_ids=[r.pk for r in self.result_list])
        for rollout in self.result_list:
            rollout.final_reward = rewards.get(rollout.pk)


@admin.register(Rollout)
class RolloutAdmin(ReadOnlyAdmin):
    list_display = ("id", "project", "status", "reward", "agent", "job_step", "attempt_count",
                    "duration", "worker", "start_time")
    list_filter = ("status", "mode", "project", JobFilter, AgentFilter)
    search_fields = ("=id", "idempotency_key")
    list_select_related = ("project", "latest_attempt")
    ordering = ("-start_time",)
    date_hierarchy = "start_time"
    inlines = [AttemptInline]
    actions = ["cancel", "requeue"]
    readonly_fields = ("reward", "duration", "error", "spans_link")
    fieldsets = [
        (None, {"fields": ("id", "project", "status", "mode", "reward", "duration", "error",
                           "spans_link")}),
        ("Input and configuration", {"fields": ("input", "config", "metadata", "resources_id",
                                                "resources_version", "priority")}),
        ("Queue and delivery", {"fields": (
            "start_time", "end_time", "enqueue_time", "queue_deadline", "idempotency_key",
            "attempt_count", "latest_attempt", "dispatch", "dispatch_target", "dispatched_at",
            "dispatch_count")}),
    ]

    def get_changelist(self, request, **kwargs):
        return RolloutChangeList

    @admin.display(description="reward")
    def reward(self, obj: Rollout) -> str:
        if not hasattr(obj, "final_reward"):
            obj.final_reward = rollout_rewards(rollout_ids=[obj.pk]).get(obj.pk)
        return "-" if obj.final_reward is None else f"{obj.final_reward:.3f}"

    @admin.display(description="agent", ordering="dispatch_target")
    def agent(self, obj: Rollout) -> str:
        return obj.dispatch_target or "-"

    @admin.display(description="job / step")
    def job_step(self, obj: Rollout) -> str:
        job, step = (obj.metadata or {}).get("trainer.job"), (obj.metadata or {}).get(
            "trainer.step")
        if job is None:
            return "-"
        return format_html('<a href="/jobs/{}/">job {}</a> / step {}', job, job, step)

    @admin.display(description="duration")
    def duration(self, obj: Rollout) -> str:
        return _seconds(obj.start_time, obj.end_time)

    @admin.display(description="worker")
    def worker(self, obj: Rollout) -> str:
        return (obj.latest_attempt.worker_id if obj.latest_attempt else None) or "-"

    @admin.display(description="error of the latest attempt")
    def error(self, obj: Rollout) -> str:
        return _error_block(obj.latest_attempt)

    @admin.display(description="spans")
    def spans_link(self, obj: Rollout) -> str:
        url = reverse("admin:store_span_changelist") + f"?rollout__id__exact={obj.pk}"
        return format_html('<a href="{}">all spans of this rollout</a>', url)

    def _change_status(self, request, queryset, status: str, verb: str) -> None:
        changed, refused = 0, []
        for rollout in queryset.select_related("project"):
            try:
                services.rollout_update(project=rollout.project, rollout_id=rollout.pk,
                                        status=status)
                changed += 1
            except StoreError as exc:
                refused.append(f"{rollout.pk}: {exc}")
        self.message_user(request, f"{verb} {changed} rollout(s).", messages.SUCCESS)
        for line in refused:
            self.message_user(request, line, messages.ERROR)

    @admin.action(description="Cancel the selected rollouts")
    def cancel(self, request, queryset):
        self._change_status(request, queryset, RolloutStatus.CANCELLED, "Cancelled")

    @admin.action(description="Requeue the selected rollouts (run them again)")
    def requeue(self, request, queryset):
        self._change_status(request, queryset, RolloutStatus.REQUEUING, "Requeued")


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin):
    list_display = ("attempt_id", "rollout", "sequence_id", "status", "worker_id", "start_time",
                    "duration", "last_heartbeat_time")
    list_filter = ("status", "rollout__project")
    search_fields = ("=attempt_id", "=rollout__id", "worker_id")
    list_select_related = ("rollout",)
    ordering = ("-start_time",)
    readonly_fields = ("rollout_link", "duration", "error", "span_tree")
    fields = ("attempt_id", "rollout_link", "sequence_id", "status", "worker_id", "start_time",
              "end_time", "duration", "last_heartbeat_time", "deadline", "error", "span_tree")

    @admin.display(description="rollout")
    def rollout_link(self, obj: Attempt) -> str:
        url = reverse("admin:store_rollout_change", args=[obj.rollout_id])
        return format_html('<a href="{}">{}</a>', url, obj.rollout_id)

    @admin.display(description="duration")
    def duration(self, obj: Attempt) -> str:
        return _seconds(obj.start_time, obj.end_time)

    @admin.display(description="error")
    def error(self, obj: Attempt) -> str:
        return _error_block(obj)

    @admin.display(description="spans")
    def span_tree(self, obj: Attempt) -> str:
        spans = list(Span.objects.filter(attempt=obj).order_by("sequence_id")[:SPAN_TREE_LIMIT])
        return render_to_string("admin/store/span_tree.html", {
            "rows": span_tree(spans), "limit": SPAN_TREE_LIMIT,
            "truncated": len(spans) == SPAN_TREE_LIMIT,
            "all_url": reverse("admin:store_span_changelist") + f"?attempt__id__exact={obj.pk}",
        })


@admin.register(Span)
class SpanAdmin(ReadOnlyAdmin):
    list_display = ("name", "rollout", "attempt", "sequence_id", "started", "duration",
                    "parent_link")
    list_filter = ("rollout__project",)
    search_fields = ("=rollout__id", "=span_id", "=trace_id", "name")
    list_select_related = ("attempt",)
    readonly_fields = ("started", "ended", "duration", "parent_link", "attributes_text")
    fields = ("name", "rollout", "attempt", "sequence_id", "trace_id", "span_id", "parent_link",
              "started", "ended", "duration", "status", "attributes_text", "events", "links",
              "resource")

    @admin.display(description="start", ordering="start_time")
    def started(self, obj: Span) -> str:
        return _epoch(obj.start_time)

    @admin.display(description="end")
    def ended(self, obj: Span) -> str:
        return _epoch(obj.end_time)

    @admin.display(description="duration")
    def duration(self, obj: Span) -> str:
        if obj.start_time is None or obj.end_time is None:
            return "-"
        return f"{(obj.end_time - obj.start_time) * 1000:.1f} ms"

    @admin.display(description="parent")
    def parent_link(self, obj: Span) -> str:
        if not obj.parent_id:
            return "-"
        parent = Span.objects.filter(attempt_id=obj.attempt_id, span_id=obj.parent_id).first()
        if parent is None:
            return obj.parent_id
        url = reverse("admin:store_span_change", args=[parent.pk])
        return format_html('<a href="{}">{} ({})</a>', url, parent.name, parent.span_id)

    @admin.display(description="attributes")
    def attributes_text(self, obj: Span) -> str:
        return format_html("<pre>{}</pre>", json.dumps(obj.attributes, indent=2, default=str))


def _epoch(value: float | None) -> str:
    if value is None:
        return "-"
    moment = datetime.fromtimestamp(value, tz=UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d} UTC"


class ResourceVersionInline(admin.TabularInline):
    model = ResourceVersion
    extra = 0
    fields = ("version", "created_at", "keep", "resources")
    readonly_fields = ("version", "created_at", "resources")
    ordering = ("-version",)
    can_delete = False

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(ResourceSet)
class ResourceSetAdmin(admin.ModelAdmin):
    list_display = ("resources_id", "project", "version", "create_time", "update_time")
    list_filter = ("project",)
    search_fields = ("=resources_id",)
    readonly_fields = ("resources_id", "project", "version", "create_time", "update_time")
    inlines = [ResourceVersionInline]

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = ("worker_id", "project", "status", "last_heartbeat_time", "last_dequeue_time",
                    "current_rollout_id")
    list_filter = ("project", "status")
    search_fields = ("worker_id",)


@admin.register(RolloutGroup)
class RolloutGroupAdmin(admin.ModelAdmin):
    list_display = ("key", "project", "owner", "finished", "total", "completed_at", "members")
    list_filter = ("owner", "project")
    search_fields = ("=key",)
    readonly_fields = ("project", "key", "owner", "total", "finished", "created_at",
                       "completed_at", "members")

    def has_add_permission(self, request) -> bool:
        return False

    @admin.display(description="Rollouts")
    def members(self, obj: RolloutGroup) -> str:
        url = reverse("admin:store_rollout_changelist") + f"?group__id__exact={obj.pk}"
        return format_html('<a href="{}">{} rollouts</a>', url, obj.total)


@admin.register(UsageEntry)
class UsageEntryAdmin(ReadOnlyAdmin):
    """The cost ledger: append-only rows, shown only (README "Cost")."""

    list_display = ("created_at", "project", "kind", "rollout_id", "attempt_id", "group_id",
                    "cpu_seconds", "gpu_seconds", "gpu_type", "tokens", "cost")
    list_filter = ("kind", "project")
    search_fields = ("rollout_id",)
    date_hierarchy = "created_at"
