"""Secrets from the environment or from mounted files (Kubernetes Secret volumes). Pure apart from reading
the named file."""

from __future__ import annotations

import os
from pathlib import Path


def secret(name: str, environ: dict[str, str] | None = None) -> str | None:
    """$NAME, or the contents of the file named by $NAME_FILE, stripped of surrounding whitespace (editors
    and `kubectl create secret --from-file` leave a trailing newline). None when neither is set; a value
    that is set but empty is an error naming it, never a silently disabled feature."""
    environ = dict(os.environ) if environ is None else environ
    if name in environ and f"{name}_FILE" in environ:
        raise ValueError(f"{name} and {name}_FILE are both set: use one")
    if name in environ:
        value, source = environ[name].strip(), name
    elif f"{name}_FILE" in environ:
        path = environ[f"{name}_FILE"]
        source = f"{name}_FILE={path}"
        try:
            value = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ValueError(f"{source}: cannot read it ({reason})") from None
    else:
        return None
    if not value:
        raise ValueError(f"{source}: the secret is empty")
    return value


def comma_list(text: str) -> tuple[str, ...]:
    """Comma- or newline-separated items (a secret file holds one per line while rotating)."""
    return tuple(part.strip() for part in text.replace("\n", ",").split(",") if part.strip())


def secret_list(name: str, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """Several secrets (rotation): comma- or newline-separated."""
    raw = secret(name, environ)
    if raw is None:
        return ()
    found = comma_list(raw)
    if not found:
        raise ValueError(f"{name}: no secret in {raw!r}")
    return found
