from __future__ import annotations

from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html

from store import services
from store.models import (
    ApiKey,
    Attempt,
    Project,
    ResourceSet,
    ResourceVersion,
    Rollout,
    Span,
    Worker,
)


class ApiKeyInline(admin.TabularInline):
    model = ApiKey
    extra = 0
    fields = ("name", "role", "prefix", "created_at", "last_used_at", "revoked_at")
    readonly_fields = ("prefix", "created_at", "last_used_at")
    can_delete = False

    def has_add_permission(self, request, obj=None) -> bool:
        return False  # keys are made with the action below, which shows the key once


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ("name", "created_at")
    search_fields = ("name",)
    inlines = [ApiKeyInline]
    actions = ["make_runner_key", "make_algorithm_key", "make_admin_key"]

    def _make_key(self, request, queryset, role: str) -> None:
        for project in queryset:
            _, raw = services.api_key_create(project=project, role=role)
            self.message_user(
                request,
                f"New {role} key for {project.name} (shown once, copy it now): {raw}",
                messages.WARNING,
            )

    @admin.action(description="Create a runner key (shown once)")
    def make_runner_key(self, request, queryset):
        self._make_key(request, queryset, ApiKey.Role.RUNNER)

    @admin.action(description="Create an algorithm key (shown once)")
    def make_algorithm_key(self, request, queryset):
        self._make_key(request, queryset, ApiKey.Role.ALGORITHM)

    @admin.action(description="Create an admin key (shown once)")
    def make_admin_key(self, request, queryset):
        self._make_key(request, queryset, ApiKey.Role.ADMIN)


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("prefix", "project", "name", "role", "created_at", "last_used_at", "revoked_at")
    list_filter = ("role", "project")
    readonly_fields = ("project", "prefix", "hashed_key", "created_at", "last_used_at")

    def has_add_permission(self, request) -> bool:
        return False


class AttemptInline(admin.TabularInline):
    model = Attempt
    extra = 0
    fields = ("attempt_id", "sequence_id", "status", "worker_id", "start_time", "end_time",
              "last_heartbeat_time", "spans_link")
    readonly_fields = fields
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(description="spans")
    def spans_link(self, obj: Attempt) -> str:
        url = reverse("admin:store_span_changelist") + f"?attempt__id__exact={obj.pk}"
        return format_html('<a href="{}">spans</a>', url)


@admin.register(Rollout)
class RolloutAdmin(admin.ModelAdmin):
    list_display = ("id", "project", "status", "mode", "priority", "attempt_count", "start_time",
                    "end_time", "spans_link")
    list_filter = ("project", "status", "mode")
    search_fields = ("=id", "idempotency_key")
    readonly_fields = ("latest_attempt",)
    list_select_related = ("project",)
    inlines = [AttemptInline]
    date_hierarchy = "start_time"

    @admin.display(description="spans")
    def spans_link(self, obj: Rollout) -> str:
        url = reverse("admin:store_span_changelist") + f"?rollout__id__exact={obj.pk}"
        return format_html('<a href="{}">spans</a>', url)


@admin.register(Attempt)
class AttemptAdmin(admin.ModelAdmin):
    list_display = ("attempt_id", "rollout", "sequence_id", "status", "worker_id", "start_time",
                    "last_heartbeat_time", "deadline")
    list_filter = ("status", "rollout__project")
    search_fields = ("=attempt_id", "=rollout__id", "worker_id")
    raw_id_fields = ("rollout",)


@admin.register(Span)
class SpanAdmin(admin.ModelAdmin):
    list_display = ("name", "rollout", "attempt", "sequence_id", "span_id", "start_time")
    list_filter = ("rollout__project",)
    search_fields = ("=rollout__id", "=span_id", "=trace_id", "name")
    list_select_related = ("attempt",)

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


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
