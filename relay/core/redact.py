"""Masking secrets for display (config check, logs). Pure."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_SECRET_NAME = re.compile(
    r"(secret|password|passwd|token|credential|private|sasl\.jaas|api[_.]?key|key\.pem|"
    r"keystore|truststore\.password)",
    re.IGNORECASE,
)
MASK = "********"


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name)) and not name.upper().endswith("_FILE")


def redact_url(url: str) -> str:
    """A connection URL with its password (and any password=... query option) masked."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, sep, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if sep else netloc
    query = re.sub(r"(password=)[^&]*", rf"\g<1>{MASK}", parts.query, flags=re.IGNORECASE)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact(name: str, value: str) -> str:
    if is_secret_name(name):
        return MASK
    if "://" in value:
        return redact_url(value)
    if "password=" in value.lower():  # a libpq keyword/value string
        return re.sub(r"(password=)\S*", rf"\g<1>{MASK}", value, flags=re.IGNORECASE)
    return value
