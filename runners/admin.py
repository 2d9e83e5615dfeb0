from __future__ import annotations

from django.contrib import admin, messages

from runners import selectors
from runners.models import CeleryWorker


@admin.register(CeleryWorker)
class CeleryWorkerAdmin(admin.ModelAdmin):
    list_display = ("name", "status", "queues", "concurrency", "cpu_count", "cuda",
                    "last_heartbeat", "started_at")
    list_filter = ("status",)
    search_fields = ("name", "hostname")
    readonly_fields = [f.name for f in CeleryWorker._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False  # workers register themselves

    @admin.display(description="CUDA")
    def cuda(self, obj: CeleryWorker) -> str:
        if not obj.cuda_devices:
            return "-"
        return f"{len(obj.cuda_devices)} GPU, {obj.cuda_memory / 2**30:.0f} GiB"

    def changelist_view(self, request, extra_context=None):
        # Work that no live worker can take is said plainly, above the list.
        for state in selectors.queue_states():
            if state.waiting_reason:
                self.message_user(request, f"Waiting: {state.waiting_reason}", messages.WARNING)
        return super().changelist_view(request, extra_context)
