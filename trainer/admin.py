from __future__ import annotations

from django.contrib import admin, messages
from django.urls import reverse
from django.utils.html import format_html

from trainer import selectors, services
from trainer.models import GangMember, TrainingJob, TrainingStep


class StepInline(admin.TabularInline):
    model = TrainingStep
    extra = 0
    can_delete = False
    fields = ("n", "status", "resources_version", "produced_version", "attempts", "device",
              "metrics")
    readonly_fields = fields
    ordering = ("n",)

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(TrainingJob)
class TrainingJobAdmin(admin.ModelAdmin):
    list_display = ("id", "project", "name", "algorithm", "status", "best_metric", "created_at",
                    "page")
    list_filter = ("status", "algorithm", "project")
    search_fields = ("name", "agent")
    readonly_fields = ("status", "error", "resources_id", "best_version", "best_metric",
                       "created_at", "started_at", "finished_at", "page", "usage")
    inlines = [StepInline]
    actions = ["cancel", "resume"]

    @admin.display(description="Cost (ledger totals)")
    def usage(self, obj: TrainingJob) -> str:
        return selectors.job_usage(job=obj).describe() if obj.pk else "-"

    @admin.display(description="Job page")
    def page(self, obj: TrainingJob) -> str:
        return format_html('<a href="{}">open</a>', reverse("trainer:job_detail", args=[obj.pk]))

    @admin.action(description="Cancel the selected jobs")
    def cancel(self, request, queryset):
        for job in queryset:
            services.job_cancel(job_id=job.pk)
        self.message_user(request, f"Cancelled {queryset.count()} job(s).", messages.SUCCESS)

    @admin.action(description="Resume the selected jobs from their last finished step")
    def resume(self, request, queryset):
        for job in queryset:
            services.job_resume(job_id=job.pk)
        self.message_user(request, f"Resumed {queryset.count()} job(s).", messages.SUCCESS)


class GangMemberInline(admin.TabularInline):
    """The rendezvous rows of a multi-node step: which workers joined which try."""

    model = GangMember
    extra = 0
    can_delete = False
    fields = ("attempt", "node_rank", "worker", "host", "pid", "master_addr", "master_port",
              "backend", "joined_at", "seen_at")
    readonly_fields = fields
    ordering = ("attempt", "node_rank")

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(TrainingStep)
class TrainingStepAdmin(admin.ModelAdmin):
    inlines = [GangMemberInline]
    list_display = ("id", "job", "n", "status", "resources_version", "produced_version",
                    "attempts", "device", "worker", "rollouts")
    list_filter = ("status", "device")
    readonly_fields = [f.name for f in TrainingStep._meta.fields] + ["rollouts"]

    @admin.display(description="Rollouts")
    def rollouts(self, obj: TrainingStep) -> str:
        return format_html('<a href="{}">{} rollouts</a>', selectors.step_rollouts_url(obj),
                           obj.rollout_count + obj.val_rollout_count)
