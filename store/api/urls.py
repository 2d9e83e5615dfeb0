"""URLs of the store API: AGL 0.3's routes under /v1/agl/, OTLP under /v1/, our schema and
docs under /api/. Operations that share a URL are joined into one class per URL (each keeps
its own handler, roles and schema)."""

from __future__ import annotations

from django.contrib.staticfiles.views import serve as serve_static
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from store.api import otlp, schema  # noqa: F401 - schema registers the auth extension
from store.api import views as v


class RolloutsEndpoint(v.QueryRolloutsView, v.StartRolloutView):
    pass


class RolloutEndpoint(v.GetRolloutView, v.UpdateRolloutView):
    pass


class AttemptsEndpoint(v.QueryAttemptsView, v.StartAttemptView):
    pass


class AttemptEndpoint(v.GetAttemptView, v.UpdateAttemptView):
    pass


class WorkerEndpoint(v.GetWorkerView, v.UpdateWorkerView):
    pass


class ResourcesEndpoint(v.QueryResourcesView, v.AddResourcesView):
    pass


class ResourceEndpoint(v.GetResourcesView, v.UpdateResourcesView, v.DeleteResourcesView):
    pass


class SpansEndpoint(v.QuerySpansView, v.AddSpanView):
    pass


agl = [
    path("health", v.HealthView.as_view()),
    path("queues/rollouts/enqueue", v.EnqueueRolloutsView.as_view()),
    path("queues/rollouts/dequeue", v.DequeueRolloutsView.as_view()),
    path("rollouts", RolloutsEndpoint.as_view()),
    path("rollouts/search", v.SearchRolloutsView.as_view()),
    path("rollouts/<str:rollout_id>", RolloutEndpoint.as_view()),
    path("rollouts/<str:rollout_id>/claim", v.ClaimRolloutView.as_view()),
    path("rollouts/<str:rollout_id>/attempts", AttemptsEndpoint.as_view()),
    path("rollouts/<str:rollout_id>/attempts/search", v.SearchAttemptsView.as_view()),
    path("rollouts/<str:rollout_id>/attempts/<str:attempt_id>", AttemptEndpoint.as_view()),
    path("rollouts/<str:rollout_id>/attempts/<str:attempt_id>/finish",
         v.FinishAttemptView.as_view()),
    path("attempts/batch", v.UpdateAttemptsBatchView.as_view()),
    path("workers", v.QueryWorkersView.as_view()),
    path("workers/search", v.SearchWorkersView.as_view()),
    path("workers/<str:worker_id>", WorkerEndpoint.as_view()),
    path("statistics", v.StatisticsView.as_view()),
    path("share", v.ShareView.as_view()),
    path("quota", v.QuotaView.as_view()),
    path("resources", ResourcesEndpoint.as_view()),
    path("resources/latest", v.LatestResourcesView.as_view()),
    path("resources/<str:resources_id>", ResourceEndpoint.as_view()),
    path("spans", SpansEndpoint.as_view()),
    path("spans/batch", v.AddSpanBatchView.as_view()),
    path("spans/search", v.SearchSpansView.as_view()),
    path("spans/next", v.NextSpanSequenceIdView.as_view()),
    path("waits/rollouts", v.WaitForRolloutsView.as_view()),
]

otlp_urls = [
    path("v1/traces", otlp.OtlpTracesView.as_view()),
    path("v1/metrics", otlp.OtlpMetricsView.as_view()),
    path("v1/logs", otlp.OtlpLogsView.as_view()),
    path("v1/development/profiles", otlp.OtlpProfilesView.as_view()),
]

docs = [
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="api-schema"), name="api-redoc"),
    # The docs pages' own assets, served from the drf-spectacular-sidecar package (no CDN),
    # also where no web server serves static files (gunicorn alone, DEBUG off).
    re_path(
        r"^static/(?P<path>drf_spectacular_sidecar/.+)$", serve_static, {"insecure": True}
    ),
]

urlpatterns = [
    path("v1/agl/", include(agl)),
    path("v1/projects", v.CreateProjectView.as_view()),
    *otlp_urls,
    *docs,
]
