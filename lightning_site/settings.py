"""Settings, read from the environment only (see README "Settings")."""

from __future__ import annotations

from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from lightning_site.env import (
    database_from_url,
    env_bool,
    env_float,
    env_int,
    env_list,
    env_str,
    sqlite_database,
)

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(env_str("LIGHTNING_DATA_DIR", str(BASE_DIR / "var")))

DEBUG = env_bool("DJANGO_DEBUG", False)
SECRET_KEY = env_str("DJANGO_SECRET_KEY")
if not SECRET_KEY:
    if not DEBUG and env_str("DATABASE_URL"):
        raise ImproperlyConfigured(
            "DJANGO_SECRET_KEY must be set when DATABASE_URL is set (a shared deployment)"
        )
    # Embedded default only: a fixed key for a single-user local store.
    SECRET_KEY = "embedded-default-insecure-key-set-DJANGO_SECRET_KEY-for-deployments"
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_celery_beat",
    "store",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "lightning_site.urls"
WSGI_APPLICATION = "lightning_site.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

_database_url = env_str("DATABASE_URL")
DATABASES = {
    "default": database_from_url(_database_url)
    if _database_url
    else sqlite_database(DATA_DIR / "lightning.sqlite3")
}
EMBEDDED = not _database_url
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(env_str("DJANGO_STATIC_ROOT", str(DATA_DIR / "static")))
MEDIA_ROOT = Path(env_str("DJANGO_MEDIA_ROOT", str(DATA_DIR / "media")))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
}

# --- The store -------------------------------------------------------------------------------
# Rows the watchdog sweep changes per batch; each batch is one short transaction.
STORE_SWEEP_BATCH_SIZE = env_int("STORE_SWEEP_BATCH_SIZE", 500, minimum=1)
# Resource versions kept per resources id by the retention service (in-use ones always kept).
STORE_RESOURCES_KEEP_LAST = env_int("STORE_RESOURCES_KEEP_LAST", 20, minimum=1)
# Default bound on how long a rollout may wait in the queue; 0 means unbounded (AGL's behaviour).
STORE_QUEUE_TIMEOUT_SECONDS = env_float("STORE_QUEUE_TIMEOUT_SECONDS", 0.0, minimum=0.0)

# --- The REST API (store/api; README "Runner API") ------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # API views authenticate with project keys (store.api.auth); no anonymous Django user.
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Lightning store API (Agent Lightning 0.3 compatible)",
    "VERSION": "0.3",
    # The docs pages load their assets from drf-spectacular-sidecar, never from a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "RolloutStatusEnum": "store.api.schema.ROLLOUT_STATUSES",
        "AttemptStatusEnum": "store.api.schema.ATTEMPT_STATUSES",
        "WorkerStatusEnum": "store.api.schema.WORKER_STATUSES",
    },
}
# Request bodies the API accepts (JSON and OTLP, after gunzip); larger ones get 413.
STORE_API_MAX_BODY_BYTES = env_int("STORE_API_MAX_BODY_BYTES", 8 * 1024 * 1024, minimum=1024)
