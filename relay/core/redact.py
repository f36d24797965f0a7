"""Masking secrets for display (config check, logs, error messages). Pure.

A value is masked for what it is, not only for the name it travels under: a URL's userinfo whatever
characters the password holds (`#`, `@`, `/` unencoded), libpq's `password=` keyword, PEM key material,
and `name=value` secrets inside a compound librdkafka value such as `sasl.oauthbearer.config`.
"""

from __future__ import annotations

import re

_SECRET_NAME = re.compile(
    r"(secret|password|passwd|pwd|token|credential|private|jaas|api[_.]?key|"
    r"(^|[._])key([._]|$)|keystore|truststore)",
    re.IGNORECASE,
)
# name=value pairs inside a value (libpq keyword strings, sasl.oauthbearer.config, JAAS lines).
_SECRET_PAIR = re.compile(
    r"(?P<name>[\w.-]*(?:secret|password|passwd|pwd|token|credential|api[_.-]?key)[\w.-]*)"
    r"(?P<sep>\s*=\s*)(?P<quote>[\"']?)(?P<value>(?(quote)[^\"']*|[^\s,;&]*))",
    re.IGNORECASE,
)
_PEM = re.compile(r"-----BEGIN [A-Z0-9 ]+-----.*?(-----END [A-Z0-9 ]+-----|\Z)", re.DOTALL)
MASK = "********"


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name)) and not name.upper().endswith(("_FILE", ".LOCATION", "_LOCATION"))


def url_password(url: str) -> str | None:
    """The password of a `scheme://user:password@host/...` URL, taken raw (a `#`, `?` or `/` in it does
    not end it, as a URL parser would decide), or None."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme:
        return None
    userinfo, at, _ = rest.rpartition("@")
    if not at:
        return None
    _, colon, password = userinfo.partition(":")
    return password if colon else None


def redact_url(url: str) -> str:
    """A connection URL with its password (and any password=... query option) masked."""
    password = url_password(url)
    if password:
        scheme, _, rest = url.partition("://")
        userinfo, _, host = rest.rpartition("@")
        user = userinfo.partition(":")[0]
        url = f"{scheme}://{user}:{MASK}@{host}"
    return _SECRET_PAIR.sub(_mask_pair, url)


def _mask_pair(match: re.Match[str]) -> str:
    quote = match.group("quote")
    return f"{match.group('name')}{match.group('sep')}{quote}{MASK}{quote}"


def redact_text(value: str) -> str:
    """Secrets inside free text masked: URL passwords, name=value secrets, PEM blocks."""
    value = _PEM.sub(MASK, value)
    value = re.sub(r"[a-z][a-z0-9+.-]*://[^\s\"']+", lambda m: redact_url(m.group(0)), value)
    return _SECRET_PAIR.sub(_mask_pair, value)


_WHOLE_URL = re.compile(r"[a-z][a-z0-9+.-]*://", re.IGNORECASE)


def redact(name: str, value: str) -> str:
    if is_secret_name(name):
        return MASK
    if _WHOLE_URL.match(value):
        return redact_url(value)  # the whole value is one URL, whatever its password holds (even spaces)
    return redact_text(value)


def scrub(text: str, *secrets: str | None) -> str:
    """`text` (an error message) with every given secret, and whatever redact_text finds, masked."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return redact_text(text)
