from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    # The store API: /v1/agl/* (AGL 0.3), /v1/traces (OTLP), /api/schema/ and /api/docs/.
    path("", include("store.api.urls")),
]
