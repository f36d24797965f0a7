"""Settings from the environment: DATABASE_URL (a libpq URL, postgresql://user:password@host:port/dbname)
and POSTBOX_SCHEMA (the outbox's schema, default postbox).

Django's PostgreSQL backend uses psycopg 3 when it is installed, psycopg2 otherwise; postbox writes through
either."""

import os
from urllib.parse import parse_qsl, unquote, urlsplit

_url = urlsplit(os.environ["DATABASE_URL"])

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(_url.path.lstrip("/")) or "postgres",
        "USER": unquote(_url.username or ""),
        "PASSWORD": unquote(_url.password or ""),
        "HOST": _url.hostname or "",
        "PORT": str(_url.port or ""),
        "OPTIONS": dict(parse_qsl(_url.query)),  # sslmode=require and the like, as libpq takes them
    }
}
POSTBOX_SCHEMA = os.environ.get("POSTBOX_SCHEMA", "postbox")

INSTALLED_APPS = ["shop"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
