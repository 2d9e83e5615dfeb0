from django.contrib import admin
from django.urls import include, path

from lightning_site import login_throttle, metrics, views
from runners.selectors import queue_states
from trainer import urls as trainer_urls

urlpatterns = [
    path("", views.home, name="home"),
    path("metrics", metrics.metrics_view, name="metrics"),
    # Before the admin's own login route: the same view, with failed logins throttled.
    path("admin/login/", login_throttle.throttled_login, name="admin-login-throttled"),
    path("admin/", admin.site.urls),
    # The store API: /v1/agl/* (AGL 0.3), /v1/traces (OTLP), /api/schema/ and /api/docs/.
    path("", include("store.api.urls")),
    # Training job pages; the runners' worker registry is handed in here (trainer never
    # imports runners).
    path("jobs/", include((trainer_urls.build(workers=queue_states), "trainer"))),
]
