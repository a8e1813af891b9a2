"""llmgw settings: everything that differs between machines comes from the environment.

The embedded defaults (SQLite, a filesystem broker, files under ./var) let a
fresh machine run the whole product with no service installed; production sets
DATABASE_URL and REDIS_URL.
"""

from __future__ import annotations

import os
import secrets
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote

from core.durations import DurationError, parse_duration
from core.env import EnvError, database_from_url, env_bool, env_int, env_list, env_str
from core.yamltext import YAMLSyntaxError, load_with_lines

from .private_files import OWNER_ONLY_UMASK, kept_secret, owner_only_folder

# Every process reads these settings first (web, gateway, worker, beat, the run command and the
# processes it starts inherit it): what any of them creates is owner-only, whatever umask the
# shell had. See llmgw_site.private_files.
os.umask(OWNER_ONLY_UMASK)

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = owner_only_folder(Path(env_str("LLMGW_VAR_DIR", str(BASE_DIR / "var"))).resolve())


def _secret_key() -> str:
    configured = env_str("LLMGW_SECRET_KEY", "")
    if configured:
        return configured
    # One key per installation, kept beside the data, so sessions survive a
    # restart without anyone having to invent a key for a local run.
    return kept_secret(VAR_DIR / "secret-key", lambda: secrets.token_urlsafe(50))


SECRET_KEY = _secret_key()
DEBUG = env_bool("LLMGW_DEBUG", False)
ALLOWED_HOSTS = env_list("LLMGW_ALLOWED_HOSTS") or ["127.0.0.1", "localhost", "[::1]", "testserver"]

# Where the control plane is reached by nodes and people; the mirror's file
# URLs are built on it.
LLMGW_PUBLIC_URL = env_str("LLMGW_PUBLIC_URL", "http://127.0.0.1:8000").rstrip("/")
# server.yaml: cluster settings and declared models. Missing file = no
# declared models and the default cluster settings.
LLMGW_CONFIG = Path(env_str("LLMGW_CONFIG", str(BASE_DIR / "server.yaml")))
# Hosts the control plane may ask about a model's source; None = server.yaml's
# sources.allowed_hosts, or the mirror's and registry's hosts.
LLMGW_SOURCE_ALLOWED_HOSTS = env_list("LLMGW_SOURCE_ALLOWED_HOSTS")
# Overrides registry.endpoint in server.yaml (the run command sets it to its demo registry).
LLMGW_REGISTRY_ENDPOINT = env_str("LLMGW_REGISTRY_ENDPOINT", "")
# Where the run command's demo registry (olah on 127.0.0.1) listens.
LLMGW_DEMO_REGISTRY_PORT = env_int("LLMGW_DEMO_REGISTRY_PORT", 8090)
# Queue a reconcile pass right after each catalog or fleet change (beat runs
# one every reconcile interval regardless).
LLMGW_KICK_RECONCILE = env_bool("LLMGW_KICK_RECONCILE", True)
# The gateway: how long a request for an on-demand model waits for a replica,
# how long a replica may stay silent, and where Prometheus keeps the numbers of
# all web worker processes (multiprocess mode; unset counts per process).
LLMGW_GATEWAY_WAIT = env_int("LLMGW_GATEWAY_WAIT", 60, minimum=0)
LLMGW_GATEWAY_UPSTREAM_TIMEOUT = env_int("LLMGW_GATEWAY_UPSTREAM_TIMEOUT", 600, minimum=1)
LLMGW_METRICS_DIR = env_str("LLMGW_METRICS_DIR", "") or None
LLMGW_SOURCE_CHECK_TIMEOUT = env_int("LLMGW_SOURCE_CHECK_TIMEOUT", 10, minimum=1)
# A canary update is checked this often (seconds), and decided on no fewer answers of its
# new revision than this (fewer are noise).
LLMGW_CANARY_CHECK_SECONDS = env_int("LLMGW_CANARY_CHECK_SECONDS", 15, minimum=1)
LLMGW_CANARY_MIN_REQUESTS = env_int("LLMGW_CANARY_MIN_REQUESTS", 20, minimum=1)
# The most one node may report (fleet.trust): a heartbeat above any of these is refused whole.
# GPU memory is per GPU. Raise them for bigger machines; they only stop typos and lies.
LLMGW_NODE_MAX_MEMORY_GB = env_int("LLMGW_NODE_MAX_MEMORY_GB", 4096, minimum=1)
LLMGW_NODE_MAX_CORES = env_int("LLMGW_NODE_MAX_CORES", 1024, minimum=1)
LLMGW_NODE_MAX_GPUS = env_int("LLMGW_NODE_MAX_GPUS", 64, minimum=0)
LLMGW_NODE_MAX_GPU_MEMORY_GB = env_int("LLMGW_NODE_MAX_GPU_MEMORY_GB", 1024, minimum=0)
# The ports nodes may declare for their engines (llmgw node --port-range): below 1024 are the
# machine's own services (ssh, http); narrow them to what your agents use.
# How often (seconds) a process writes the node renewals it took, all in one UPDATE
# (fleet.liveness); 0 writes each at once.
LLMGW_RENEWAL_FLUSH_SECONDS = env_int("LLMGW_RENEWAL_FLUSH_SECONDS", 1, minimum=0)
LLMGW_NODE_PORT_MIN = env_int("LLMGW_NODE_PORT_MIN", 1024, minimum=1)
LLMGW_NODE_PORT_MAX = env_int("LLMGW_NODE_PORT_MAX", 65535, minimum=1)
# Active gateway keys one user may hold (staff too; revoked keys do not count): every gateway
# process keeps every key in memory, so one user must not be able to make that list unbounded.
LLMGW_MAX_KEYS_PER_USER = env_int("LLMGW_MAX_KEYS_PER_USER", 100, minimum=1)
# Below this much free space (MB, of 1024**2 bytes) on the disk holding LLMGW_VAR_DIR (the SQLite
# database, the mirror, the logs, the local node's cache) the run command warns, the console shows
# a banner and /metrics says llmgw_var_low_free 1. 0: never warn.
LLMGW_VAR_LOW_FREE_MB = env_int("LLMGW_VAR_LOW_FREE_MB", 1024, minimum=0)
# Mirror space (GB, of 1024**3 bytes) a plain user's `model serve` may take: the files their
# serves hold in the mirror plus those being fetched. 0: only staff may serve. Staff: no quota.
LLMGW_SERVE_QUOTA_GB = env_int("LLMGW_SERVE_QUOTA_GB", 50, minimum=0)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "axes",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_htmx",
    "template_partials",
    "accounts",
    "catalog",
    "fleet",
    "registry",
    "access",
    "gateway",
    "console",
    # Sign-in through the company's OpenID Connect provider (LLMGW_OIDC_*), and the switch for
    # local passwords.
    "signin",
    # The process-starting commands (llmgw_run) and start-up; no models.
    "llmgw_site",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Static files (console CSS, htmx, admin) from the web process itself: no separate server.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # A view's write that met a full disk: 507 with the path and the room left, not a 500.
    "llmgw_site.api_errors.DiskFullMiddleware",
    # Last, as django-axes asks: it answers a locked-out login with the lockout page.
    "axes.middleware.AxesMiddleware",
]

# Sign-in through the company's OpenID Connect provider (docs/signin.md): authorization code
# with PKCE, people made at their first sign-in. An empty issuer turns it off (passwords only).
# The issuer exactly as the provider names itself (its discovery document's "issuer"); llmgw
# asks only its scheme, host and port, and the hosts in LLMGW_OIDC_ALLOWED_HOSTS (Google keeps
# its keys and token endpoint on hosts of their own).
LLMGW_OIDC_ISSUER = env_str("LLMGW_OIDC_ISSUER", "")
LLMGW_OIDC_CLIENT_ID = env_str("LLMGW_OIDC_CLIENT_ID", "")
# A file holding the client secret, owned by llmgw's account and readable by it alone (0600):
# every process refuses to start otherwise. Never the secret itself in the environment.
LLMGW_OIDC_CLIENT_SECRET_FILE = env_str("LLMGW_OIDC_CLIENT_SECRET_FILE", "")
LLMGW_OIDC_SCOPES = env_str("LLMGW_OIDC_SCOPES", "openid email profile groups offline_access")
# The ID token's claim holding the person's groups (a dotted path reaches into objects, as
# Keycloak's realm_access.roles).
LLMGW_OIDC_GROUPS_CLAIM = env_str("LLMGW_OIDC_GROUPS_CLAIM", "groups")
# The login button says "Sign in with ..." this.
LLMGW_OIDC_PROVIDER_NAME = env_str("LLMGW_OIDC_PROVIDER_NAME", "your company")
LLMGW_OIDC_ALLOWED_HOSTS = env_list("LLMGW_OIDC_ALLOWED_HOSTS") or []
# Groups to roles (access.roles reads it; docs/signin.md gives its form).
LLMGW_OIDC_GROUP_MAP = env_str("LLMGW_OIDC_GROUP_MAP", "")
# Off: password logins (console and admin) are refused but for the usernames below, the
# break-glass administrators, who can still get in when the provider is down. API tokens are
# not passwords and keep working.
LLMGW_LOCAL_PASSWORDS = env_bool("LLMGW_LOCAL_PASSWORDS", True)
LLMGW_BREAK_GLASS_USERS = env_list("LLMGW_BREAK_GLASS_USERS") or ["admin"]
# `llmgw ctl login` (signin.device): the API token it gives expires after this many days.
LLMGW_CLI_TOKEN_DAYS = env_int("LLMGW_CLI_TOKEN_DAYS", 30, minimum=1)
# People who signed in through the provider are asked about again (their refresh token) once
# this long has passed: removed or disabled there, or left without a mapped group, they leave
# (signin.leavers). With beat's run every 20 s, a leaver is found within a minute while up to
# 300 such people are checked (a run asks about at most 100).
LLMGW_OIDC_RECHECK_SECONDS = env_int("LLMGW_OIDC_RECHECK_SECONDS", 40, minimum=10)

# Login throttling (console and admin logins, the only password logins; the API takes tokens,
# 24 random bytes, which cannot be guessed). Failures are counted per username and, apart,
# per client address, in the database, so every web process sees them (SQLite or PostgreSQL);
# either count at the limit refuses password logins. llmgw_site.login_throttle says why, and
# what a lockout by others leaves working (API tokens, sessions already logged in).
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    # Django's ModelBackend, refusing passwords while LLMGW_LOCAL_PASSWORDS is off (but for
    # LLMGW_BREAK_GLASS_USERS): the console's login and the admin's both go through it.
    "signin.backends.PasswordBackend",
    # Sessions made by a sign-in through the provider (signin.views); it checks no password.
    "signin.backends.ProviderBackend",
]
AXES_FAILURE_LIMIT = env_int("LLMGW_LOGIN_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("LLMGW_LOGIN_LOCKOUT_MINUTES", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = ["ip_address", "username"]
# The address is the peer the web process saw, never a header the client wrote.
AXES_CLIENT_IP_CALLABLE = "llmgw_site.login_throttle.client_address"
# The right password clears its own account's failures (login_throttle.forget_own_failures):
# axes' reset would clear the address's count too, which an attacker's own account could do.
AXES_RESET_ON_SUCCESS = False
# A login tried while locked out (the right password too) neither counts nor restarts the
# cool-off, so a user trying again does not prolong their own lockout.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_LOCKOUT_CALLABLE = "llmgw_site.login_throttle.lockout_response"
# Failed attempts are what is worth keeping; a row per successful login is not.
AXES_DISABLE_ACCESS_LOG = True

ROOT_URLCONF = "llmgw_site.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                # The banner saying the disk holding LLMGW_VAR_DIR is running out of room.
                "console.context_processors.disk_space",
                # The login pages' ways in: the provider's button, the password form or not.
                "signin.context_processors.signin",
            ],
        },
    },
]

WSGI_APPLICATION = "llmgw_site.wsgi.application"

# SQLite in var/ unless DATABASE_URL says otherwise: it moves with LLMGW_VAR_DIR, beside the
# secret key and the broker it goes with (without LLMGW_VAR_DIR, still ./var/llmgw.sqlite3 of the
# checkout, where earlier versions kept it).
DATABASES = {
    "default": database_from_url(
        # Quoted: a folder's name may hold what a URL reads otherwise ('#', '?', '%').
        env_str("DATABASE_URL", f"sqlite:///{quote(str(VAR_DIR / 'llmgw.sqlite3'))}"),
        base_dir=BASE_DIR,
    )
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Definitions are small; a body this large is a mistake or an attack.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("LLMGW_MAX_BODY_BYTES", 1024 * 1024, minimum=1024)

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)
# Served from the apps' folders as they are, so that no collectstatic step is needed.
WHITENOISE_USE_FINDERS = True
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "llmgw_site.auth.TokenOrBearerAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": [
        # Both hold bodies to DATA_UPLOAD_MAX_MEMORY_SIZE and parsed documents to the
        # bounds of core.yamltext (aliases, depth, digits, duplicate keys).
        "llmgw_site.parsers.JSONParser",
        "llmgw_site.parsers.YAMLParser",
    ],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "EXCEPTION_HANDLER": "llmgw_site.api_errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}

# The API's schema (/api/v1/schema) and its docs page (/api/v1/docs) answer only those logged in
# (a console session or an API token), as the rest of /api/v1/ does: the schema maps every
# operation, which is more than an anonymous visitor needs. true opens both to everyone.
LLMGW_PUBLIC_API_DOCS = env_bool("LLMGW_PUBLIC_API_DOCS", False)

SPECTACULAR_SETTINGS = {
    "TITLE": "llmgw control plane API",
    "DESCRIPTION": "The catalog of models, their scaling, resources, owners, adapters and audit trail.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Request bodies get components of their own (ModelDefinitionRequest beside ModelDefinition),
    # so that a required name can say minLength: 1 where it is sent; an answer's text may be
    # empty where its serializer allows it.
    "COMPONENT_SPLIT_REQUEST": True,
    # The schema describes tokens; console sessions work too, but are for the browser.
    "AUTHENTICATION_WHITELIST": [
        "llmgw_site.auth.TokenOrBearerAuthentication",
        "fleet.api.NodeTokenAuthentication",
    ],
    "ENUM_NAME_OVERRIDES": {
        "GatewayKeyState": ["active", "revoked"],
        "ReplicaReportState": ["fetching", "starting", "ready", "failed", "stopped"],
    },
}

# Celery: Redis when REDIS_URL is set; otherwise a broker kept in files under
# var/, which needs nothing installed and serves one machine.
REDIS_URL = env_str("REDIS_URL", "")
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {}
else:
    # Owner-only like var/: a task's message names what it acts on, and the folders may predate
    # the umask set above.
    _broker_dir = owner_only_folder(VAR_DIR / "broker")
    for _sub in ("queue", "processed", "control"):
        owner_only_folder(_broker_dir / _sub)
    from .broker import ALIAS as _BROKER_ALIAS

    # kombu's filesystem transport, writing each message whole (see llmgw_site.broker).
    CELERY_BROKER_URL = f"{_BROKER_ALIAS}://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "queue"),
        "data_folder_out": str(_broker_dir / "queue"),
        "processed_folder": str(_broker_dir / "processed"),
        "store_processed": False,
        "control_folder": str(_broker_dir / "control"),
    }
CELERY_TASK_IGNORE_RESULT = True
# Separate queues let several installations (or test systems) share one Redis.
CELERY_TASK_DEFAULT_QUEUE = env_str("LLMGW_CELERY_QUEUE", "celery")


def _schedule_seconds(section: str, key: str, default: int) -> int:
    """A schedule from server.yaml; the full validation at start reports a bad value.

    Read through the same bounded reader as everything else: this runs in every
    process before the start-up check, so a hostile file must not stall it.
    """
    try:
        data, _ = load_with_lines(LLMGW_CONFIG.read_text()) if LLMGW_CONFIG.exists() else ({}, {})
        return parse_duration(data.get(section, {}).get(key)) or default
    except (OSError, ValueError, YAMLSyntaxError, AttributeError, DurationError):
        return default


CELERY_BEAT_SCHEDULE = {
    "reconcile": {
        "task": "fleet.tasks.reconcile",
        "schedule": _schedule_seconds("cluster", "reconcile_interval", 5),
    },
    # Rollouts read their state from the database, so a pass every few seconds
    # also resumes one that a restart interrupted.
    "advance-rollouts": {"task": "registry.tasks.advance_rollouts", "schedule": 2.0},
    "check-updates": {
        "task": "registry.tasks.check_updates",
        "schedule": _schedule_seconds("mirror", "update_check", 6 * 3600),
    },
    # Minutes of traffic older than a day become hours; older than a week, nothing.
    "fold-traffic": {"task": "access.tasks.fold_traffic", "schedule": 600.0},
    "sample-capacity": {"task": "fleet.tasks.sample_capacity", "schedule": 60.0},
    # GGUF header facts of files no model uses (plans of definitions never added).
    "forget-unused-files": {"task": "fleet.tasks.forget_unused_files", "schedule": 600.0},
    "check-canaries": {
        "task": "access.tasks.check_canaries",
        "schedule": float(LLMGW_CANARY_CHECK_SECONDS),
    },
    # Only while sign-in through a provider is configured does it ask anything.
    "check-members": {"task": "signin.tasks.check_members", "schedule": 20.0},
}
# One beat sends, however many run (llmgw_site.leader): the holder of a lease in the database,
# this many seconds long, renewed every third of it. A standby takes over within about this long
# (plus its 2 s poll) after the holder dies; shorter turns a database pause into a takeover.
CELERY_BEAT_SCHEDULER = "llmgw_site.beat:LeaderScheduler"
LLMGW_BEAT_LEASE_SECONDS = env_int("LLMGW_BEAT_LEASE_SECONDS", 15, minimum=3)
CELERY_TASK_ALWAYS_EAGER = env_bool("LLMGW_TASKS_EAGER", False)
CELERY_TASK_TIME_LIMIT = 600
CELERY_TASK_SOFT_TIME_LIMIT = 540
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# Every process (web, worker, beat, gateway) logs to stderr, one line per event: a 5xx
# (django.request) or a failed task (celery.app.trace) comes with its traceback
# on the same line, so nothing that went wrong leaves no trace. A line about a request names
# its X-Request-ID. LLMGW_LOG_FORMAT=json: one JSON object a line. LLMGW_LOG_FILE (the run
# command sets it for each process): every line to that file too, and on stderr only warnings,
# errors and llmgw's own INFO (see llmgw_site.logformat).
_LOG_LEVEL = env_str("LLMGW_LOG_LEVEL", "INFO")
_LOG_FORMAT = env_str("LLMGW_LOG_FORMAT", "").strip().lower() or "text"
if _LOG_FORMAT not in ("text", "json"):
    raise EnvError(
        f"LLMGW_LOG_FORMAT={os.environ['LLMGW_LOG_FORMAT']!r} is not a log format: use text "
        "(the default, for people) or json (one object a line, for machines)."
    )
_LOG_FILE = env_str("LLMGW_LOG_FILE", "")
# Each file under var/log is rotated to .1 at this size (0: never, for a logrotate of your own),
# keeping this many rotated files: the run command's processes, the gunicorn access log
# (llmgw_site.gunicornlog) and the gateway's access log (its own LLMGW_ACCESS_LOG_* settings).
LLMGW_LOG_MAX_BYTES = env_int("LLMGW_LOG_MAX_BYTES", 50 * 1024 * 1024, minimum=0)
LLMGW_LOG_BACKUPS = env_int("LLMGW_LOG_BACKUPS", 5, minimum=1)
_LOG_HANDLERS: dict[str, dict[str, object]] = {
    "stderr": {
        "class": "logging.StreamHandler",
        "formatter": _LOG_FORMAT,
        "filters": ["full_disk_once", *(["for_the_terminal"] if _LOG_FILE else [])],
    },
}
if _LOG_FILE:
    Path(_LOG_FILE).parent.mkdir(parents=True, exist_ok=True)
    _LOG_HANDLERS["file"] = {
        # Several processes write one file (gunicorn's and uvicorn's workers, Celery's pool):
        # rotated by one of them at a time, and reopened when logrotate moves it away.
        "class": "core.logfiles.SharedRotatingFileHandler",
        "filename": _LOG_FILE,
        "max_bytes": LLMGW_LOG_MAX_BYTES,
        "backups": LLMGW_LOG_BACKUPS,
        "formatter": _LOG_FORMAT,
        "filters": ["full_disk_once"],
    }
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "text": {"()": "llmgw_site.logformat.OneLineFormatter"},
        "json": {"()": "llmgw_site.logformat.JSONFormatter"},
    },
    "filters": {
        "once_per_source": {"()": "llmgw_site.logformat.OncePerSource", "capacity": 1024},
        "for_the_terminal": {"()": "llmgw_site.logformat.ForTheTerminal"},
        # A write that met a full disk: one line, once a minute, not a traceback a retry.
        "full_disk_once": {"()": "llmgw_site.logformat.FullDiskOnce"},
    },
    "handlers": _LOG_HANDLERS,
    "root": {"handlers": list(_LOG_HANDLERS), "level": "WARNING"},
    "loggers": {
        # 4xx answers are the asker's mistake and are in the access log; 5xx are ours.
        "django.request": {"level": "ERROR"},
        # A request with a foreign Host header: once per client address, at WARNING, without
        # the traceback Django adds (see OncePerSource).
        "django.security.DisallowedHost": {"filters": ["once_per_source"]},
        **{
            name: {"level": _LOG_LEVEL}
            for name in ("llmgw", "catalog", "fleet", "access", "gateway", "console")
        },
    },
}
