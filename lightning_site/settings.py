"""Settings, read from the environment only (see README "Settings")."""

from __future__ import annotations

import warnings
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from core.devices import parse_override as devices_parse_override
from core.env import (
    database_from_url,
    env_bool,
    env_float,
    env_int,
    env_list,
    env_prices,
    env_str,
    sqlite_database,
)

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(env_str("LIGHTNING_DATA_DIR", str(BASE_DIR / "var")))

DEBUG = env_bool("DJANGO_DEBUG", False)
SECRET_KEY = env_str("DJANGO_SECRET_KEY")
if not SECRET_KEY:
    if env_str("DATABASE_URL"):
        # DEBUG or not: a shared database means sessions and signatures others can forge
        # with a key published in this file.
        raise ImproperlyConfigured(
            "DJANGO_SECRET_KEY must be set when DATABASE_URL is set (a shared deployment)"
        )
    # Embedded default only: a fixed key for a single-user local store.
    SECRET_KEY = "embedded-default-insecure-key-set-DJANGO_SECRET_KEY-for-deployments"

# HTTPS (README "Settings"): off by default, because compose's workers and runners reach the
# API over plain HTTP inside their network; a deployment behind TLS turns them on (all of them
# on is what `manage.py check --deploy` asks for).
SECURE_SSL_REDIRECT = env_bool("DJANGO_SECURE_SSL_REDIRECT", False)
# The health check is probed over plain HTTP from inside the container (docker-compose.yml).
SECURE_REDIRECT_EXEMPT = [r"^v1/agl/health$"]
SECURE_HSTS_SECONDS = env_int("DJANGO_SECURE_HSTS_SECONDS", 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("DJANGO_SECURE_HSTS_PRELOAD", False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = env_bool("DJANGO_SECURE_COOKIES", False)
if env_bool("DJANGO_SECURE_PROXY_SSL_HEADER", False):
    # Behind a TLS-terminating proxy that sets X-Forwarded-Proto (and strips a client's own).
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", [])
# The admin's login: failed logins per user name (4x per client address) within the window,
# then 429 until it passes (lightning_site/login_throttle.py).
ADMIN_LOGIN_MAX_FAILURES = env_int("ADMIN_LOGIN_MAX_FAILURES", 5, minimum=1)
ADMIN_LOGIN_LOCKOUT_SECONDS = env_int("ADMIN_LOGIN_LOCKOUT_SECONDS", 900, minimum=1)
# "web" is the API server's name inside docker-compose.yml's network (workers and runners there).
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "web"])

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
    "runners",
    "trainer",
]

MIDDLEWARE = [
    # Request counts and latency per route for /metrics (lightning_site.metrics).
    "lightning_site.metrics.RequestMetricsMiddleware",
    # A NUL in the URL is a 400 (Postgres refuses it in a query): lightning_site/badpath.py.
    "lightning_site.badpath.RefuseNulPathMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Static files (the admin's CSS, the API docs' assets) in every mode, DEBUG or not.
    "whitenoise.middleware.WhiteNoiseMiddleware",
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
# Full times (seconds) in the admin and pages: lightning_site/formats/en/formats.py.
FORMAT_MODULE_PATH = ["lightning_site.formats"]

STATIC_URL = "static/"
STATIC_ROOT = Path(env_str("DJANGO_STATIC_ROOT", str(DATA_DIR / "static")))
MEDIA_ROOT = Path(env_str("DJANGO_MEDIA_ROOT", str(DATA_DIR / "media")))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    # Compressed copies are made by collectstatic (the image runs it); without it WhiteNoise
    # serves the apps' own files through the finders (below).
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
    # Training checkpoints (trainer.checkpoints); point the backend at object storage (e.g.
    # django-storages' S3 backend, configured by its own settings) to share them across hosts.
    "checkpoints": {
        "BACKEND": env_str(
            "CHECKPOINT_STORAGE_BACKEND", "django.core.files.storage.FileSystemStorage"
        ),
        "OPTIONS": {"location": env_str("CHECKPOINT_DIR", str(MEDIA_ROOT / "checkpoints"))}
        if env_str("CHECKPOINT_STORAGE_BACKEND") is None
        else {},
    },
}

# Serve straight from the apps' static folders too, so `./lightning serve` and the embedded
# default need no collectstatic step; files collected into STATIC_ROOT are served as well.
WHITENOISE_USE_FINDERS = True
# ...so an empty STATIC_ROOT (nothing collected yet) is normal, not worth a warning per process.
warnings.filterwarnings("ignore", message="No directory at")
# Links on the landing page; Flower runs as its own process (README "Distributed").
FLOWER_URL = env_str("FLOWER_URL", "http://localhost:5555/")
# /metrics answers staff sessions, and scrapers sending `Authorization: Bearer METRICS_TOKEN`
# (unset: staff only). README "Operate".
METRICS_TOKEN = env_str("METRICS_TOKEN") or None

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
# A claimed attempt that never reports (no heartbeat, status or span) is unresponsive after this
# many seconds whatever its config: a lost dequeue answer never strands a rollout. 0: no bound.
STORE_FIRST_REPORT_SECONDS = env_float("STORE_FIRST_REPORT_SECONDS", 300.0, minimum=0.0)
# A claim that never reported whose worker gave no sign of life (dequeue, heartbeat, report)
# for this many seconds is unresponsive at once: its runner died right after the claim. 0: off.
STORE_SILENT_WORKER_SECONDS = env_float("STORE_SILENT_WORKER_SECONDS", 20.0, minimum=0.0)
# The fair share's memory (README "Scheduling"): a party's usage (its claims) halves every this
# many seconds, so a job that ran alone for an hour is not starved for an hour when another
# arrives, but a burst does not buy its party a fresh start either.
SCHEDULER_USAGE_HALF_LIFE_SECONDS = env_float("SCHEDULER_USAGE_HALF_LIFE_SECONDS", 600.0,
                                              minimum=0.001)
# The price list of the cost ledger (README "Cost"), applied when a ledger row is written:
# per CPU-second, per GPU-second by device type (the first name contained in the device's
# name, else "*"), per 1000 tokens the model gateway generated. Units are the operator's.
COST_PER_CPU_SECOND = env_float("COST_PER_CPU_SECOND", 0.00001, minimum=0.0)
COST_PER_GPU_SECOND = env_prices("COST_PER_GPU_SECOND", {"H200": 0.0012, "H100": 0.001,
                                                        "A100": 0.0006, "*": 0.0004})
COST_PER_1K_TOKENS = env_float("COST_PER_1K_TOKENS", 0.0002, minimum=0.0)

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
    # The schema describes the store API, not the view that serves the schema.
    "SERVE_INCLUDE_SCHEMA": False,
    # Every operation's error answers, `null` answers and exact path ids (store/api/schema.py).
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "store.api.schema.declare_errors",
    ],
    "ENUM_NAME_OVERRIDES": {
        "RolloutStatusEnum": "store.api.schema.ROLLOUT_STATUSES",
        "AttemptStatusEnum": "store.api.schema.ATTEMPT_STATUSES",
        "WorkerStatusEnum": "store.api.schema.WORKER_STATUSES",
    },
}
# Request bodies the API accepts (JSON and OTLP, after gunzip); larger ones get 413.
STORE_API_MAX_BODY_BYTES = env_int("STORE_API_MAX_BODY_BYTES", 8 * 1024 * 1024, minimum=1024)
# The ASGI server (lightning_site/asgi.py): server-side waits (waits/rollouts, a long-polled
# dequeue) at once per API key and per project, in each server process; past either, 429.
STORE_API_MAX_WAITS_PER_KEY = env_int("STORE_API_MAX_WAITS_PER_KEY", 16, minimum=1)
STORE_API_MAX_WAITS_PER_PROJECT = env_int("STORE_API_MAX_WAITS_PER_PROJECT", 64, minimum=1)
# Seconds a request's whole body may take to arrive (slow uploads), else 408.
WEB_BODY_TIMEOUT_SECONDS = env_int("WEB_BODY_TIMEOUT_SECONDS", 30, minimum=1)

# --- Celery (core/celery.py; README "Distributed") --------------------------------------------
_broker_url = env_str("CELERY_BROKER_URL")
# No DATABASE_URL and no broker: the embedded default runs its workers in-process
# (core.embedded) over Celery's in-memory transport.
EMBEDDED_WORKERS = EMBEDDED and not _broker_url
CELERY_BROKER_URL = _broker_url or (
    # A host name, or kombu warns "No hostname was supplied" at every connection.
    "memory://localhost/" if EMBEDDED_WORKERS else "amqp://guest:guest@127.0.0.1:5672//"
)
# State lives in the database; the result backend is not a database, so results are dropped.
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
# Ack after the task ran: a worker that dies mid-rollout leaves its message to be delivered again.
CELERY_TASK_ACKS_LATE = True
# A pool process killed mid-task (OOM, kill -9) requeues its message instead of acking it.
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# Long tasks: each process reserves only the task it runs; the rest wait for idle processes.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Soft limit: the task gets SoftTimeLimitExceeded and records the attempt as failed.
CELERY_TASK_SOFT_TIME_LIMIT = env_int("CELERY_TASK_SOFT_TIME_LIMIT", 3600, minimum=1)
# Hard limit: the process is killed if it ignores the soft one (the watchdog then takes over).
CELERY_TASK_TIME_LIMIT = env_int(
    "CELERY_TASK_TIME_LIMIT", CELERY_TASK_SOFT_TIME_LIMIT + 60, minimum=CELERY_TASK_SOFT_TIME_LIMIT
)
CELERY_BROKER_TRANSPORT_OPTIONS = {
    # Redis re-delivers an unacked message after this many seconds: it must exceed the longest
    # task, or a rollout still running is delivered a second time (harmless, but wasted).
    "visibility_timeout": CELERY_TASK_TIME_LIMIT + 600,
}
if CELERY_BROKER_URL.startswith(("amqp", "pyamqp")):
    # Publisher confirms: a publish counts as sent only once RabbitMQ has taken it. Without
    # them a message written just before the broker went away was lost with no error, its
    # rollout (or step) left to the 300 s re-send age (tests/test_broker_outage.py).
    CELERY_BROKER_TRANSPORT_OPTIONS["confirm_publish"] = True
if EMBEDDED_WORKERS:
    # The in-memory transport is polled: poll often, one process needs no broker round trips.
    CELERY_BROKER_TRANSPORT_OPTIONS["polling_interval"] = 0.05
if env_str("CELERY_REDIS_KEY_PREFIX"):
    # Redis only: several deployments (or test sessions) share one Redis without sharing queues.
    CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] = env_str("CELERY_REDIS_KEY_PREFIX")
# RabbitMQ's consumer_timeout is a server setting (rabbitmq.conf, docker-compose.yml sets it):
# it must also exceed CELERY_TASK_TIME_LIMIT, or the broker closes the channel of a long task.
# Keep retrying the broker at start: in compose the workers often start before RabbitMQ.
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Reconnect to a broker that went away within 2 s of its return (core/consumer.py), and keep
# trying for as long as it is away: Celery's 100 tries would end the worker after ~3 minutes.
CELERY_WORKER_CONSUMER = "core.consumer:Consumer"
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
# Work that names no queue is housekeeping; every task of ours names its queue anyway.
CELERY_TASK_DEFAULT_QUEUE = "control"
# Each task declares its queue (`lightning_queue=Queue.X`); this router reads the declaration.
CELERY_TASK_ROUTES = ("core.queues.route_task",)
# Flower shows tasks as they are sent and run.
CELERY_WORKER_SEND_TASK_EVENTS = env_bool("CELERY_EVENTS", True)
CELERY_TASK_SEND_SENT_EVENT = CELERY_WORKER_SEND_TASK_EVENTS
CELERY_TIMEZONE = "UTC"
# Periodic tasks are declared in CELERY_BEAT_SCHEDULE and synced into django-celery-beat's tables.
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"

# --- Runners (the executor, runners/executor.py) ---------------------------------------------
# Seconds between heartbeats of a running attempt (the watchdog's unresponsive check reads them).
RUNNERS_HEARTBEAT_SECONDS = env_float("RUNNERS_HEARTBEAT_SECONDS", 5.0, minimum=0.05)
# When the store has ended an attempt (timeout, unresponsive, cancelled) whose agent still runs,
# the agent is stopped; if it has not returned this many seconds later, a prefork pool process
# exits and the pool replaces it (the slot is freed). Threads cannot be stopped: they are left
# to finish, shown as slots held by ended attempts (README "Hung agents").
RUNNERS_STOP_GRACE_SECONDS = env_float("RUNNERS_STOP_GRACE_SECONDS", 5.0, minimum=0.0)
# Spans are shipped when this many are waiting, or at the next heartbeat.
RUNNERS_SPAN_BATCH_SIZE = env_int("RUNNERS_SPAN_BATCH_SIZE", 100, minimum=1)
# Rollouts enqueued for Celery without an unresponsive limit get this one (0: none), so an
# attempt whose worker was killed is noticed by the watchdog instead of running forever.
RUNNERS_DEFAULT_UNRESPONSIVE_SECONDS = env_float(
    "RUNNERS_DEFAULT_UNRESPONSIVE_SECONDS", 120.0, minimum=0.0
)
# A queued rollout whose message was sent this long ago is sent again (its message may be lost;
# a duplicate only costs a no-op claim). Requeued rollouts (retries) are sent at once.
RUNNERS_REDISPATCH_SECONDS = env_float("RUNNERS_REDISPATCH_SECONDS", 300.0, minimum=0.0)
# Rollout tasks run at once by the embedded default's in-process worker (threads).
EMBEDDED_ROLLOUT_CONCURRENCY = env_int("EMBEDDED_ROLLOUT_CONCURRENCY", 4, minimum=1)
# ... for jobs whose agents call the model gateway (grpo_lm): they mostly wait on it, and the
# more calls arrive together, the larger the gateway's batches.
EMBEDDED_LLM_ROLLOUT_CONCURRENCY = env_int("EMBEDDED_LLM_ROLLOUT_CONCURRENCY", 16, minimum=1)

# --- The scaling signal (core/scaling.py, README "Scaling") -------------------------------------
# lightning_desired_workers{queue} = ceil((queued + running) / slots per worker), kept within
# [MIN, MAX]. Slots per worker: what `celery -c` gives one worker; 0 takes the mean concurrency
# of the queue's live workers (1 when none is live).
SCALE_ROLLOUTS_MIN_WORKERS = env_int("SCALE_ROLLOUTS_MIN_WORKERS", 1, minimum=0)
SCALE_ROLLOUTS_MAX_WORKERS = env_int("SCALE_ROLLOUTS_MAX_WORKERS", 20, minimum=0)
SCALE_ROLLOUTS_SLOTS_PER_WORKER = env_int("SCALE_ROLLOUTS_SLOTS_PER_WORKER", 0, minimum=0)
SCALE_TRAINING_MIN_WORKERS = env_int("SCALE_TRAINING_MIN_WORKERS", 0, minimum=0)
SCALE_TRAINING_MAX_WORKERS = env_int("SCALE_TRAINING_MAX_WORKERS", 4, minimum=0)
SCALE_TRAINING_SLOTS_PER_WORKER = env_int("SCALE_TRAINING_SLOTS_PER_WORKER", 1, minimum=0)

# --- The worker registry and the periodic control work ----------------------------------------
# Celery workers heartbeat this often; silent for WORKERS_LOST_AFTER_SECONDS, they are "lost".
WORKERS_HEARTBEAT_SECONDS = env_float("WORKERS_HEARTBEAT_SECONDS", 15.0, minimum=0.1)
WORKERS_LOST_AFTER_SECONDS = env_float("WORKERS_LOST_AFTER_SECONDS", 60.0, minimum=1.0)
# The CUDA devices a worker registers and claims training steps with (core/devices.py):
# unset, torch's; set (JSON, `[{"name": "NVIDIA A100-SXM4-80GB", "memory_gb": 80}]`, `[]` for
# none), these instead: tests, and a CPU machine described as something else.
try:
    WORKERS_CUDA_DEVICES = devices_parse_override(env_str("WORKERS_CUDA_DEVICES"))
except ValueError as exc:
    raise ImproperlyConfigured(f"WORKERS_CUDA_DEVICES {exc}") from None
# The address this training worker's TCPStore listens on and the other nodes of a gang reach it
# at, when it is node 0 of a multi-node step (trainer/gang.py): the host's address on the
# network the training nodes share; 127.0.0.1 when every node is on one machine.
TRAINING_GANG_ADDR = env_str("TRAINING_GANG_ADDR", "127.0.0.1")
# The store's watchdog sweep, and reconciliation (re-sends, lost workers), in seconds.
LIGHTNING_SWEEP_SECONDS = env_int("LIGHTNING_SWEEP_SECONDS", 5, minimum=1)
LIGHTNING_RECONCILE_SECONDS = env_int("LIGHTNING_RECONCILE_SECONDS", 15, minimum=1)
# Synced into django-celery-beat's tables by its DatabaseScheduler. Each run expires after one
# interval: with no control worker up, stale sweeps must not pile up in the queue.
CELERY_BEAT_SCHEDULE = {
    "store-watchdog-sweep": {
        "task": "runners.sweep",
        "schedule": LIGHTNING_SWEEP_SECONDS,
        "options": {"queue": "control", "expires": LIGHTNING_SWEEP_SECONDS},
    },
    "reconcile": {
        "task": "runners.reconcile",
        "schedule": LIGHTNING_RECONCILE_SECONDS,
        "options": {"queue": "control", "expires": LIGHTNING_RECONCILE_SECONDS},
    },
}

# --- The model gateway (trainer/llm; README "Training LLM agents") ---------------------------
# Where `llm_serve` (and the embedded default's gateway thread) listens.
LLM_GATEWAY_HOST = env_str("LLM_GATEWAY_HOST", "127.0.0.1")
LLM_GATEWAY_PORT = env_int("LLM_GATEWAY_PORT", 4748, minimum=0)
# The base URL agents are given in their `llm` resource (AGL's ProxyLLM endpoint); the runner
# adds /rollout/{rollout_id}/attempt/{attempt_id} before /v1 for each attempt.
LLM_GATEWAY_URL = env_str("LLM_GATEWAY_URL", f"http://{LLM_GATEWAY_HOST}:{LLM_GATEWAY_PORT}/v1")
# Checkpoint versions kept loaded at once (older ones are dropped when their requests finish).
LLM_GATEWAY_MAX_VERSIONS = env_int("LLM_GATEWAY_MAX_VERSIONS", 2, minimum=1)
# Training jobs' models (one per resources id) a project keeps loaded at once; loading one more
# drops that project's least recently used (trainer/llm/registry.py).
LLM_GATEWAY_MAX_MODELS_PER_PROJECT = env_int("LLM_GATEWAY_MAX_MODELS_PER_PROJECT", 4, minimum=1)
# Limits a gateway request meets before any work is done for it: body size (413), the time its
# body may take to arrive (408), and max_tokens (400).
LLM_GATEWAY_MAX_BODY_BYTES = env_int("LLM_GATEWAY_MAX_BODY_BYTES", 4 * 2**20, minimum=1024)
LLM_GATEWAY_BODY_TIMEOUT_SECONDS = env_float("LLM_GATEWAY_BODY_TIMEOUT_SECONDS", 30.0,
                                             minimum=0.1)
LLM_GATEWAY_MAX_TOKENS = env_int("LLM_GATEWAY_MAX_TOKENS", 4096, minimum=1)
# Sequences (n per call) a project may have in flight in the gateway; past it, 429 with
# Retry-After (trainer/llm/gateway.py). Batches take tenants in turn (trainer/llm/batcher.py).
LLM_GATEWAY_MAX_SEQUENCES_PER_PROJECT = env_int("LLM_GATEWAY_MAX_SEQUENCES_PER_PROJECT", 256,
                                                minimum=1)
# Continuous batching (trainer/llm/batcher.py): at most LLM_GATEWAY_MAX_BATCH sequences decode
# at once (a project with nothing decoding joins even a full batch); requests join a batch in
# progress at its next step; when nothing decodes, the first request waits this many
# milliseconds for others to start with it.
LLM_GATEWAY_BATCH_WINDOW_MS = env_float("LLM_GATEWAY_BATCH_WINDOW_MS", 5.0, minimum=0.0)
LLM_GATEWAY_MAX_BATCH = env_int("LLM_GATEWAY_MAX_BATCH", 64, minimum=1)
# While more than one project has work, one project decodes at most this many sequences; its
# others wait or are set aside with their caches (trainer/llm/batcher.py), so a flood leaves
# another project's call a step about this wide. 0: no cap (a flood may fill the batch).
LLM_GATEWAY_PROJECT_BATCH_ROWS = env_int("LLM_GATEWAY_PROJECT_BATCH_ROWS", 8, minimum=0)
# A project counts as having work (capping the others) until this long after its last
# sequence left: one calling again and again keeps a flood capped between its calls.
LLM_GATEWAY_PROJECT_IDLE_MS = env_float("LLM_GATEWAY_PROJECT_IDLE_MS", 500.0, minimum=0.0)
# Threads for the gateway's database work (authentication, attribution, recording), each with
# its Postgres connection (README "Deploy": the connection budget); a call holds one only
# while it touches the database, not while it waits for the engine.
LLM_GATEWAY_THREADS = env_int("LLM_GATEWAY_THREADS", 64, minimum=1)
# The recorder (trainer/llm/calls.py): threads that store calls' spans, each with its Postgres
# connection, taking the projects in turn; a turn stores at most this many calls of one project
# in one write. Two writers or more: one project's write never delays another's call.
LLM_GATEWAY_RECORD_WRITERS = env_int("LLM_GATEWAY_RECORD_WRITERS", 2, minimum=1)
LLM_GATEWAY_RECORD_TURN_CALLS = env_int("LLM_GATEWAY_RECORD_TURN_CALLS", 16, minimum=1)
# LoRA versions as adapters on one shared copy of their base (trainer/llm/adapters.py: memory
# for many jobs/versions of one base), instead of a merged copy each (fastest decoding; measured
# on SmolLM2-135M, 2 busy CPU cores: 24.6 against 29.3 tokens/s with one torch thread, 6.7
# against 47.5 with two; README "Pretrained models and LoRA").
LLM_GATEWAY_SHARE_BASE = env_bool("LLM_GATEWAY_SHARE_BASE", False)
# vLLM's runtime LoRA endpoints (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`;
# vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING) on this gateway, for algorithm/admin keys, each
# adapter in its key's project (trainer/llm/runtime_lora.py). Off: the routes are 404.
LLM_GATEWAY_ALLOW_RUNTIME_LORA_UPDATING = env_bool("LLM_GATEWAY_ALLOW_RUNTIME_LORA_UPDATING",
                                                   False)
# How often the gateway looks for newly published versions of the models it serves.
LLM_GATEWAY_POLL_SECONDS = env_float("LLM_GATEWAY_POLL_SECONDS", 1.0, minimum=0.05)
# torch's CPU threads in a process that runs the gateway (0: torch's default, one per core).
# Decoding is many small steps: on a busy machine, threads that wait for each other cost more
# than they bring (seen here: 20 ms per token alone with 2 threads, 3 ms with 1). Raise it
# for large models served on a CPU; on CUDA it does not matter.
LLM_GATEWAY_TORCH_THREADS = env_int("LLM_GATEWAY_TORCH_THREADS", 1, minimum=0)
# `llm_serve` and its engine process: Python's switch interval (sys.setswitchinterval), the
# longest a thread that wants the GIL waits for a busy one to hand it over. Python's default
# (5 ms) is paid at each of a call's handoffs between threads (the event loop, the database
# threads, the recorder; the engine process's pipe reader and decode loop); 0: the default.
# 0.5 ms: the gateway's p50 Server-Timing at 16 sessions 12.6-24.1 ms against 33.4-33.5 with
# the default in interleaved runs here (README "Benchmarks").
LLM_GATEWAY_SWITCH_INTERVAL_MS = env_float("LLM_GATEWAY_SWITCH_INTERVAL_MS", 0.5, minimum=0.0)
# `llm_serve`: the models, decode loop and batcher in a process of their own (spawned and
# supervised by the gateway, trainer/llm/engine_client.py), away from the GIL of the process
# doing HTTP, authentication and recording. Off: all in one process (as the embedded default).
LLM_GATEWAY_ENGINE_PROCESS = env_bool("LLM_GATEWAY_ENGINE_PROCESS", True)
# The same for the embedded default's gateway (a thread of `train`'s process).
LLM_EMBEDDED_ENGINE_PROCESS = env_bool("LLM_EMBEDDED_ENGINE_PROCESS", False)
# ... and its switch interval while the embedded gateway runs (0: Python's default).
LLM_EMBEDDED_SWITCH_INTERVAL_MS = env_float("LLM_EMBEDDED_SWITCH_INTERVAL_MS", 0.0, minimum=0.0)
# Upstream mode: forward to this OpenAI-compatible server (vLLM, SGLang) instead of a local
# engine, recording the token ids it returns.
LLM_GATEWAY_UPSTREAM_URL = env_str("LLM_GATEWAY_UPSTREAM_URL")
LLM_GATEWAY_UPSTREAM_KEY = env_str("LLM_GATEWAY_UPSTREAM_KEY", "")
# Models served without a job: "name=/path/to/checkpoint-dir,other=/path" (local directories
# in Hugging Face format, or model ids already in the local Hugging Face cache).
LLM_GATEWAY_MODELS = env_list("LLM_GATEWAY_MODELS", [])
# Local copies of checkpoints kept in storage that is not on this filesystem.
CHECKPOINT_CACHE_DIR = Path(env_str("CHECKPOINT_CACHE_DIR", str(DATA_DIR / "checkpoint-cache")))
# Models the examples build on first use.
MODELS_DIR = Path(env_str("LIGHTNING_MODELS_DIR", str(DATA_DIR / "models")))
