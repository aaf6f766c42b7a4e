"""One settings module for every environment, driven by environment variables (see .env.example).

Embedded defaults (SQLite, a filesystem Celery broker, local media) need no server at all; setting
DATABASE_URL / CELERY_BROKER_URL / storage variables moves the same code onto PostgreSQL, Redis and S3.
"""
from decimal import Decimal
from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent.parent  # the repository root
VAR_DIR = Path(environ.Env().str("MUNINN_VAR_DIR", default=str(BASE_DIR / "var")))

env = environ.Env()
if (BASE_DIR / ".env").exists():
    environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

# Off unless set: a deployment that forgets it serves the site's own error pages, never Django's debug pages.
# `make run`, `make demo` and the tests set it explicitly.
DEBUG = env.bool("DEBUG", default=False)
# SECRET_KEY, or the key `make run` keeps in MUNINN_VAR_DIR/secret-key (so the management commands it prints
# work from a plain shell), or with DEBUG on a fixed development key.
_key_file = VAR_DIR / "secret-key"
SECRET_KEY = env.str("SECRET_KEY", default="") or (_key_file.read_text().strip() if _key_file.is_file() else "") or (
    "insecure-dev-key-only-for-debug" if DEBUG else None
)
if not SECRET_KEY:
    raise RuntimeError("SECRET_KEY must be set when DEBUG is off")
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["*"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])
# Served over TLS (the default with DEBUG off): cookies only over HTTPS, plain HTTP redirected, HSTS for a year.
# MUNINN_TLS=false for a site on plain HTTP (`make run` on localhost). Behind a proxy that terminates TLS, set
# MUNINN_PROXY_SSL_HEADER=HTTP_X_FORWARDED_PROTO (the header it sets to "https"), and MUNINN_NUM_PROXIES to
# how many proxies add to X-Forwarded-For (the throttles count the client's address).
MUNINN_TLS = env.bool("MUNINN_TLS", default=not DEBUG)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = SECURE_SSL_REDIRECT = MUNINN_TLS
SECURE_HSTS_SECONDS = env.int("MUNINN_HSTS_SECONDS", default=365 * 24 * 3600 if MUNINN_TLS else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = SECURE_HSTS_PRELOAD = env.bool("MUNINN_HSTS_SUBDOMAINS", default=MUNINN_TLS)
if _proxy_header := env.str("MUNINN_PROXY_SSL_HEADER", default=""):
    SECURE_PROXY_SSL_HEADER = (_proxy_header, "https")
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]  # a load balancer's health check speaks plain HTTP

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, served from static/ (the docs page loads nothing from a CDN)
    "accounts",
    "jobs",
    "billing",
    "contributors",
]

MIDDLEWARE = [
    "muninn.middleware.BodyLimitMiddleware",  # first: an oversized body is refused before anything reads it
    "django.middleware.security.SecurityMiddleware",
    "contributors.hotpath.WorkerHotPathMiddleware",  # claims and heartbeats, answered here as their views would
    "muninn.middleware.ContentSecurityPolicyMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "muninn.throttles.LoginThrottleMiddleware",  # the login, admin login and sign-up forms' rate limits
    "contributors.versions.WorkerVersionMiddleware",  # 426 for a worker client older than the site speaks to
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
# Every page's scripts, styles and images come from the site itself (static/), with none inline: an injected
# <script>, handler or style does nothing, and no other site may frame a page or receive its forms. Browsers
# hold a form's redirects to form-action too: the top-up and payout-setup forms end on Stripe's hosted pages.
MUNINN_CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'; form-action 'self' https://checkout.stripe.com https://connect.stripe.com"
)

ROOT_URLCONF = "muninn.urls"
WSGI_APPLICATION = "muninn.wsgi.application"
ASGI_APPLICATION = "muninn.asgi.application"

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
            "builtins": ["muninn.ui"],  # money, hu, error_where: filters every page uses
        },
    },
]

# --- Database -------------------------------------------------------------------------------------
DATABASES = {
    "default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'muninn.sqlite3'}"),
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several local processes (web, Celery worker, beat) share one file: WAL lets readers run beside the
    # writer, IMMEDIATE transactions take the write lock up front instead of failing on upgrade.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 30, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"}
    )
else:
    DATABASES["default"].setdefault("CONN_MAX_AGE", env.int("CONN_MAX_AGE", default=60))
    # Django turns psycopg's prepared statements off (None); the worker API's fixed SQL (muninn/sql.py) asks for them
    # statement by statement, and nothing else prepares: the ORM's cursors bind on the client, which never prepares.
    # (A pooler in transaction mode, such as PgBouncer's, needs its prepared-statement support turned on.)
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault("prepare_threshold", 5)
    # Those prepared statements run on one plan each, made the first time (PostgreSQL's generic plan), instead of a
    # plan made afresh for each run's values: PostgreSQL kept planning every claim anew (0.8 ms of its CPU, against
    # 0.1 ms to run it), judging its plan for any values slower. The fixed SQL writes the constants a plan depends on
    # into its text (sql.literal) so that one plan is the right one. Only prepared statements are affected.
    _options = DATABASES["default"]["OPTIONS"]
    if "plan_cache_mode" not in _options.get("options", ""):
        _options["options"] = f"{_options.get('options', '')} -c plan_cache_mode=force_generic_plan".strip()
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_USER_MODEL = "accounts.User"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "start"  # each role's own first page
LOGOUT_REDIRECT_URL = "home"
# Password-reset mail: printed on the console unless EMAIL_URL names a server (smtp://user:pass@host:587).
_email = env.email_url("EMAIL_URL", default="consolemail://")
EMAIL_BACKEND = _email["EMAIL_BACKEND"]
EMAIL_HOST, EMAIL_PORT = _email.get("EMAIL_HOST", ""), _email.get("EMAIL_PORT", 25)
EMAIL_HOST_USER, EMAIL_HOST_PASSWORD = _email.get("EMAIL_HOST_USER", ""), _email.get("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = _email.get("EMAIL_USE_TLS", False)
DEFAULT_FROM_EMAIL = env.str("DEFAULT_FROM_EMAIL", default="Muninn <no-reply@localhost>")

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# --- Files ----------------------------------------------------------------------------------------
STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
WHITENOISE_USE_FINDERS = True
STATICFILES_DIRS = [p for p in [BASE_DIR / "static"] if p.exists()]
MEDIA_ROOT = Path(env.str("MEDIA_ROOT", default=str(VAR_DIR / "media")))
MEDIA_URL = "media/"
# Blobs (datasets, shards, weights, results, models: jobs/storage.py) are local files under MEDIA_ROOT unless
# AWS_STORAGE_BUCKET_NAME names an S3-compatible bucket (AWS S3, MinIO, Cloudflare R2, ...), reached through
# django-storages and boto3 with django-storages' own setting names. The keys are boto3's: AWS_ACCESS_KEY_ID and
# AWS_SECRET_ACCESS_KEY from the environment (or an instance role); they are never copied into settings.
AWS_STORAGE_BUCKET_NAME = env.str("AWS_STORAGE_BUCKET_NAME", default="")
AWS_S3_ENDPOINT_URL = env.str("AWS_S3_ENDPOINT_URL", default="") or None  # unset for AWS itself
AWS_S3_REGION_NAME = env.str("AWS_S3_REGION_NAME", default="") or None
AWS_S3_ADDRESSING_STYLE = env.str("AWS_S3_ADDRESSING_STYLE", default="") or None  # "path" for most MinIO setups
AWS_LOCATION = env.str("AWS_LOCATION", default="")  # a prefix inside the bucket, to share it with other data
AWS_S3_FILE_OVERWRITE = True  # a blob's name is the hash of its bytes: the same name is the same object
AWS_DEFAULT_ACL = None  # the bucket's own policy (private): blobs are only ever served through the site
STORAGES = {
    # Else any Django storage backend by dotted path (STORAGE_BACKEND), by default local files under MEDIA_ROOT.
    "default": {"BACKEND": "storages.backends.s3.S3Storage" if AWS_STORAGE_BUCKET_NAME else env.str(
        "STORAGE_BACKEND", default="django.core.files.storage.FileSystemStorage")},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
DATA_UPLOAD_MAX_MEMORY_SIZE = 5 * 1024 * 1024
FILE_UPLOAD_MAX_MEMORY_SIZE = 5 * 1024 * 1024

# --- API ------------------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "EXCEPTION_HANDLER": "muninn.errors.api_exception_handler",
    "DEFAULT_SCHEMA_CLASS": "muninn.openapi.AutoSchema",
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "muninn.negotiation.JsonFallbackNegotiation",  # never a 406
    "DEFAULT_THROTTLE_RATES": {},
    "NUM_PROXIES": env.int("MUNINN_NUM_PROXIES", default=None),
}
# Rate limits per scope (muninn/throttles.py), DRF's "N/period"; "" turns a scope off. MUNINN_THROTTLE_<SCOPE>
# (upper case, "-" as "_") overrides one, e.g. MUNINN_THROTTLE_CLAIM=1200/min.
MUNINN_THROTTLES = {scope: env.str("MUNINN_THROTTLE_" + scope.upper().replace("-", "_"), default=rate) for scope, rate in {
    "login-address": "30/min",  # logins and token requests from one address
    "login-username": "10/min",  # ... and for one username, from anywhere
    "signup-address": "10/hour",  # new accounts from one address
    "device-registration": "30/hour",  # new devices of one account (at most MUNINN_MAX_DEVICES_PER_ACCOUNT active)
    "claim": "600/min",  # one device's claims: an honest client claims after each unit or a 25 s long poll
    "heartbeat": "600/min",  # one device's heartbeats (every few seconds per held unit)
    "predict": "120/min",  # one customer's prediction requests (each bounded by MUNINN_PREDICT_MAX_*)
}.items()}
# The cache the throttles count in: CACHE_URL (redis://host:6379/1: shared by every web process, as a site on
# several machines needs); by default each process's memory (one machine).
CACHES = {"default": env.cache_url("CACHE_URL", default="locmemcache://")}
# The OpenAPI schema (GET /api/schema, read at /api/docs) is generated from the views, serializers and their
# extend_schema declarations (muninn/openapi.py); tests/test_api_contract.py holds the site to it.
SPECTACULAR_SETTINGS = {
    "TITLE": "Muninn API",
    "VERSION": "0.1.0",
    "DESCRIPTION": (
        "The JSON API of Muninn, a marketplace for distributed AI training: customers upload datasets and run "
        "jobs, contributors' devices train work units (the worker protocol: docs/worker-protocol.md). "
        "Every error has the shape `{\"error\": {\"code\", \"message\", \"detail\"}}`."),
    "SCHEMA_PATH_PREFIX": "/api/",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,  # request and response shapes apart: write-only fields, file uploads
    # <id:...> (muninn/converters.py): a database id; a longer one matches no URL, a 404
    "PATH_CONVERTER_OVERRIDES": {"id": {"type": "integer", "format": "int64", "minimum": 1, "maximum": 2**63 - 1}},
    # One name per set of choices that several fields share (spectacular would otherwise number them)
    "ENUM_NAME_OVERRIDES": {
        "RoleEnum": "accounts.models.User.Role",
        "SignupRoleEnum": ["customer", "contributor"],
        "AlgorithmEnum": "jobs.models.Job.Algorithm",
        "JobStatusEnum": "jobs.models.Job.Status",
        "RoundStatusEnum": "jobs.models.Round.Status",
        "ResultStatusEnum": "contributors.models.Receipt.Status",
        "PeerCheckStatusEnum": "contributors.models.PeerCheck.Status",
        "PayoutStatusEnum": "billing.models.Payout.Status",
        "TopUpStatusEnum": "billing.models.TopUp.Status",
    },
    "SWAGGER_UI_DIST": "SIDECAR",
    # No validator badge: Swagger UI would fetch it from validator.swagger.io
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "validatorUrl": None},
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
}

# --- Celery ---------------------------------------------------------------------------------------
# Default: a filesystem transport (muninn/broker.py), a broker that needs no server (one machine only).
CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default="muninnfs://")
if CELERY_BROKER_URL.startswith(("muninnfs://", "filesystem://")):
    _broker_dir = VAR_DIR / "broker"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "queue"),
        "data_folder_out": str(_broker_dir / "queue"),
        "control_folder": str(_broker_dir / "control"),
        "polling_interval": 0.1,
    }
    for _d in ("queue", "control"):
        (_broker_dir / _d).mkdir(parents=True, exist_ok=True)
elif CELERY_BROKER_URL.startswith(("redis://", "rediss://")):
    # A task is acknowledged when it ends (acks_late), so Redis keeps each delivered message aside until then and
    # hands it out again after this many seconds without an ack. It must outlast the longest task (a
    # re-execution of a whole round's unit can take most of an hour): shorter, and a task still running is run a
    # second time beside itself. Nothing waits on it for recovery: a killed worker's work is picked up within
    # MUNINN_STALL_SECONDS by beat's sweepers (resume-stalled-jobs, sweep-pending-verifications); this only
    # bounds when its message itself comes back, to find the work done. Celery's default, said out loud.
    CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": env.int("MUNINN_BROKER_VISIBILITY_TIMEOUT",
                                                                     default=3600)}
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True  # a worker killed mid-task leaves its task on the queue; tasks are idempotent
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# When the broker connection drops mid-task, let the task finish its (idempotent) work rather than cancel it: its
# ack is lost either way, and a redelivery finds the work done. Said explicitly: Celery 6 changes the default.
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ALWAYS_EAGER = env.bool("CELERY_TASK_ALWAYS_EAGER", default=False)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ROUTES = {"contributors.tasks.verify_unit": {"queue": "validation"}}
# A round or job whose message was lost (a broker restart, a killed worker) is resumed after this long;
# a re-execution waiting twice as long is enqueued again. Short in the fault suite, so its scenarios stay quick.
MUNINN_STALL_SECONDS = env.int("MUNINN_STALL_SECONDS", default=30)
# Torch threads per Celery process (segment re-executions, aggregation). One: a validator scales by processes
# (--concurrency, one per core), and a process with a pool of its own beside others oversubscribes the cores. On
# this 2-core machine, with the web and clients busy, an 8-step MLP segment took p90 376 ms on 2 threads against
# 37 ms on one (2026-11-25). Raise it only on a validator machine running one process.
MUNINN_TASK_TORCH_THREADS = env.int("MUNINN_TASK_TORCH_THREADS", default=1)
# Celery's Django fix-up closes every database connection before and after each task unless this is set, so each
# segment check opened a connection and warmed a new PostgreSQL backend's catalog caches: ~40 % of a check's time
# under bench/round_latency.py (py-spy, 2026-11-25). Kept instead, as the web keeps its own: closed by
# muninn.celery when broken or older than CONN_MAX_AGE (SQLite's 0: after every task, as before).
CELERY_DB_REUSE_MAX = 1_000_000
# An accepted result's charge is posted in batches off the request (contributors.credit): one message per this many
# seconds from each web process, for every job's pending credits, run that many seconds later, instead of one per
# result (contributors.tasks; a message per result was ~4 % of the web's CPU under bench/load.py, py-spy); a
# contributor sees an accepted result's earnings within about a second.
MUNINN_CREDIT_BATCH_SECONDS = env.float("MUNINN_CREDIT_BATCH_SECONDS", default=1.0)
CELERY_BEAT_SCHEDULE = {
    "sweep-pending-verifications": {"task": "contributors.tasks.sweep_pending_verifications",
                                    "schedule": float(MUNINN_STALL_SECONDS)},
    "sweep-pending-credits": {"task": "contributors.tasks.sweep_pending_credits",
                              "schedule": float(MUNINN_STALL_SECONDS)},
    "resume-stalled-jobs": {"task": "jobs.tasks.resume_stalled_jobs", "schedule": MUNINN_STALL_SECONDS / 3},
    "requeue-expired-leases": {"task": "jobs.tasks.requeue_expired_leases", "schedule": 5.0},
    "close-overdue-rounds": {"task": "jobs.tasks.close_overdue_rounds", "schedule": 5.0},  # + re-issues stragglers
    # Starts and stops each running job's MUNINN_JOB_WAIT_LIMIT clock; fails the jobs past it.
    "check-waiting-jobs": {"task": "contributors.tasks.check_waiting_jobs",
                           "schedule": env.float("MUNINN_WAIT_CHECK_SECONDS", default=60.0)},
    "clear-earnings": {"task": "billing.tasks.clear_earnings", "schedule": 600.0},
    "retry-approved-payouts": {"task": "billing.tasks.retry_approved_payouts", "schedule": 300.0},
}
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")

# --- Muninn ---------------------------------------------------------------------------------------
MUNINN_CURRENCY = env.str("MUNINN_CURRENCY", default="EUR")
MUNINN_PRICE_PER_HU = Decimal(env.str("MUNINN_PRICE_PER_HU", default="0.21"))
MUNINN_CONTRIBUTOR_SHARE = Decimal(env.str("MUNINN_CONTRIBUTOR_SHARE", default="0.70"))
# The minimum charge per job: no job is quoted (held) less than this, and a job that succeeds pays at least this,
# the difference above its verified work going to the platform (billing.services.minimum_charge_settle); a job
# that fails or is cancelled pays only for its verified work. Every verified unit earns its contributor at least
# MUNINN_MIN_EARNING_PER_UNIT (the platform's fee makes up what the customer's share does not cover). Amounts in
# the currency.
MUNINN_MIN_CHARGE_PER_JOB = Decimal(env.str("MUNINN_MIN_CHARGE_PER_JOB", default="0.50"))
MUNINN_MIN_EARNING_PER_UNIT = Decimal(env.str("MUNINN_MIN_EARNING_PER_UNIT", default="0.00001"))
MUNINN_LEASE_SECONDS = env.int("MUNINN_LEASE_SECONDS", default=120)
# Units a device may hold at once (the worker client trains one at a time): a unit held is a unit nobody else
# can run, and a device that holds without uploading slows every round it holds.
MUNINN_MAX_LEASES_PER_DEVICE = env.int("MUNINN_MAX_LEASES_PER_DEVICE", default=2)
# A device that let a lease expire gets no shard reserved for it at a round's planning for this long.
MUNINN_ABANDON_COOLDOWN_SECONDS = env.int("MUNINN_ABANDON_COOLDOWN_SECONDS", default=3600)
# Long-poll claims (contributors/push.py): a device may ask the site to hold its claim up to this many seconds
# until a unit is queued for it. Each held claim holds a web thread (and, on PostgreSQL, its connection), so a
# process holds at most MUNINN_CLAIM_WAITERS of them and answers the rest 204 at once with a Retry-After: run the
# web with more threads than that (scripts/stack.py: 16 threads for 8 waiters) so results and downloads get some.
MUNINN_CLAIM_WAIT_MAX = env.float("MUNINN_CLAIM_WAIT_MAX", default=30.0)
MUNINN_CLAIM_WAITERS = env.int("MUNINN_CLAIM_WAITERS", default=8)
# How a held claim learns that units were queued (jobs/wakeups.py): Redis pub/sub when there is a Redis (the
# broker's, unless set), else a stamp file under MUNINN_VAR_DIR (one machine). Either way it also re-checks
# this often, for what no event announces (a refused unit's backoff running out, a shard's reservation lapsing).
MUNINN_WAKEUP_REDIS_URL = env.str("MUNINN_WAKEUP_REDIS_URL", default=(
    CELERY_BROKER_URL if CELERY_BROKER_URL.startswith(("redis://", "rediss://")) else ""))
MUNINN_WAKEUP_DIR = env.str("MUNINN_WAKEUP_DIR", default=str(VAR_DIR / "wakeups"))
MUNINN_CLAIM_RECHECK_SECONDS = env.float("MUNINN_CLAIM_RECHECK_SECONDS", default=1.0)
MUNINN_RESERVATION_SECONDS = env.int("MUNINN_RESERVATION_SECONDS", default=10)  # a shard waits this long for its device
MUNINN_DEVICE_ONLINE_SECONDS = env.int("MUNINN_DEVICE_ONLINE_SECONDS", default=60)
# Active devices one contributor account may register (50 fresh devices split a round into slivers).
MUNINN_MAX_DEVICES_PER_ACCOUNT = env.int("MUNINN_MAX_DEVICES_PER_ACCOUNT", default=10)
# A quote warns before the customer pays when no device able to run the job has been seen for this long.
MUNINN_DEVICE_RECENT_SECONDS = env.int("MUNINN_DEVICE_RECENT_SECONDS", default=24 * 3600)
# A running job with no capable device online and in good standing (unquarantined) for this long fails and
# its unused hold is released. Devices that are only busy with other work do not count against it.
MUNINN_JOB_WAIT_LIMIT = env.int("MUNINN_JOB_WAIT_LIMIT", default=4 * 3600)
# Round deadlines adapt to the plan and to arrivals (jobs/deadlines.py) within [MIN, MAX]; past the soft one
# stragglers are re-issued, past twice it the round closes with its verified updates. GRACE covers transfers.
MUNINN_ROUND_DEADLINE_SECONDS = env.int("MUNINN_ROUND_DEADLINE_SECONDS", default=900)
MUNINN_ROUND_DEADLINE_MIN_SECONDS = env.float("MUNINN_ROUND_DEADLINE_MIN_SECONDS", default=10.0)
MUNINN_ROUND_GRACE_SECONDS = env.float("MUNINN_ROUND_GRACE_SECONDS", default=5.0)
# Re-executed results must match to this relative distance (honest runs on other CPUs/thread counts: ~1e-7).
# A refused unit waits before it is leased again: this many seconds, doubling with each refusal, up to the max.
MUNINN_UNIT_BACKOFF_SECONDS = env.float("MUNINN_UNIT_BACKOFF_SECONDS", default=2.0)
MUNINN_UNIT_BACKOFF_MAX_SECONDS = env.float("MUNINN_UNIT_BACKOFF_MAX_SECONDS", default=60.0)
# A device has this long to upload the checkpoints of the segments the site challenged; past it, the check
# counts as failed. Segment tolerances come from measurements (contributors/data/tolerances.json).
MUNINN_CHALLENGE_SECONDS = env.int("MUNINN_CHALLENGE_SECONDS", default=300)
# The oldest worker client the site still speaks to: an older one is answered 426 with its upgrade command.
MUNINN_MIN_WORKER_VERSION = env.str("MUNINN_MIN_WORKER_VERSION", default="0.1.0")
# The worker client's wheel the site serves at /downloads/: built from worker_client/ on first request (or by
# `manage.py build_worker_wheel` at release), unless this names one built elsewhere.
MUNINN_WORKER_WHEEL = env.str("MUNINN_WORKER_WHEEL", default="")
# The share of a trusted device's results that get a segment check (contributors/reputation.py). 1 (default):
# every result, so no update reaches a model unchecked. Lower trades that for validator time: a long streak is
# then checked at this rate only, and work accepted unchecked that is later found suspect is only flagged.
MUNINN_MIN_CHECK_RATE = env.float("MUNINN_MIN_CHECK_RATE", default=1.0)
# The backends whose segments the site's validation workers re-run (set the same on the web processes and on
# the Celery workers of the "validation" queue). The CPU validator re-runs CUDA segments within the tolerance
# measured for other devices' arithmetic; a unit of a backend not listed is checked by a second device of that
# backend (a peer check), and by the site's validator only when no peer takes it within MUNINN_PEER_CHECK_SECONDS.
MUNINN_VALIDATOR_BACKENDS = env.list("MUNINN_VALIDATOR_BACKENDS", default=["cpu", "cuda"])
MUNINN_PEER_CHECK_SECONDS = env.int("MUNINN_PEER_CHECK_SECONDS", default=600)
MUNINN_MAX_UPLOAD_BYTES = env.int("MUNINN_MAX_UPLOAD_BYTES", default=50 * 1024 * 1024)
# Predictions on the site (POST /api/jobs/<id>/predict, the job page's "Try the model"): bounds on one request's
# input, which bound its compute. Larger batches: the downloaded package predicts anywhere (README).
MUNINN_PREDICT_MAX_ROWS = env.int("MUNINN_PREDICT_MAX_ROWS", default=10_000)
MUNINN_PREDICT_MAX_BYTES = env.int("MUNINN_PREDICT_MAX_BYTES", default=10 * 1024 * 1024)
MUNINN_PREDICT_MAX_LENGTH = env.int("MUNINN_PREDICT_MAX_LENGTH", default=500)  # tokens a language model generates
MUNINN_MAX_RESULT_BYTES = env.int("MUNINN_MAX_RESULT_BYTES", default=512 * 1024 * 1024)
MUNINN_MAX_ROUNDS = env.int("MUNINN_MAX_ROUNDS", default=200)
MUNINN_SITE_URL = env.str("MUNINN_SITE_URL", default="http://127.0.0.1:8000")  # for Stripe's return links
# The site's Ed25519 key, which signs training certificates (muninn/site_key.py); its public half is served at
# /.well-known/muninn-signing-key. Base64 of the 32 raw private bytes, or a file holding that. Neither set: a key is
# made once and kept in MUNINN_VAR_DIR/signing-key, so it survives restarts. Several web machines: set the same key.
MUNINN_SIGNING_KEY = env.str("MUNINN_SIGNING_KEY", default="")
MUNINN_SIGNING_KEY_FILE = env.str("MUNINN_SIGNING_KEY_FILE", default="")
# The key that wraps each sensitive dataset's own key (jobs/sealing.py): base64 of 32 random bytes. Unset: derived
# from SECRET_KEY (HKDF), so changing SECRET_KEY would make every sensitive dataset's data unreadable. Production
# sets it, the same on every machine, and keeps it apart from the bucket (with the database's backups).
MUNINN_DATA_KEY = env.str("MUNINN_DATA_KEY", default="")

# --- Money ----------------------------------------------------------------------------------------
MUNINN_QUOTE_TTL_SECONDS = env.int("MUNINN_QUOTE_TTL_SECONDS", default=30 * 60)
MUNINN_ROUND_OVERHEAD_SECONDS = env.float("MUNINN_ROUND_OVERHEAD_SECONDS", default=5.0)  # for expected wall time
MUNINN_EARNINGS_HOLD_SECONDS = env.int("MUNINN_EARNINGS_HOLD_SECONDS", default=7 * 24 * 3600)
MUNINN_TOPUP_MIN = Decimal(env.str("MUNINN_TOPUP_MIN", default="5.00"))
MUNINN_TOPUP_MAX = Decimal(env.str("MUNINN_TOPUP_MAX", default="5000.00"))
MUNINN_PAYOUT_MIN = Decimal(env.str("MUNINN_PAYOUT_MIN", default="10.00"))
# Credited to every customer who signs up (a `grant` with its audit row), so a site without Stripe is usable end
# to end. Off (0) unless set: scripts/run.sh (`make run`) sets it to 100.00 unless the environment says otherwise.
MUNINN_DEMO_CREDIT = Decimal(env.str("MUNINN_DEMO_CREDIT", default="0"))
# The most one staff credit (the /staff/credits/ form) may add, against typos.
MUNINN_CREDIT_MAX = Decimal(env.str("MUNINN_CREDIT_MAX", default="10000.00"))

# --- Stripe (unset: top-ups and payouts are disabled, with a message saying so) ----------------------
STRIPE_SECRET_KEY = env.str("STRIPE_SECRET_KEY", default="")
STRIPE_WEBHOOK_SECRET = env.str("STRIPE_WEBHOOK_SECRET", default="")
STRIPE_API_BASE = env.str("STRIPE_API_BASE", default="https://api.stripe.com")
STRIPE_WEBHOOK_TOLERANCE_SECONDS = env.int("STRIPE_WEBHOOK_TOLERANCE_SECONDS", default=300)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    "loggers": {"django.server": {"level": "WARNING"}},
}
