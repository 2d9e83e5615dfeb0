from django.contrib import admin
from django.urls import include, path

from lightning_site import metrics, views
from runners.selectors import queue_states
from trainer import urls as trainer_urls

urlpatterns = [
    path("", views.home, name="home"),
    path("metrics", metrics.metrics_view, name="metrics"),
    path("admin/", admin.site.urls),
    # The store API: /v1/agl/* (AGL 0.3), /v1/traces (OTLP), /api/schema/ and /api/docs/.
    path("", include("store.api.urls")),
    # Training job pages; the runners' worker registry is handed in here (trainer never
    # imports runners).
    path("jobs/", include((trainer_urls.build(workers=queue_states), "trainer"))),
]
