"""Secrets from the environment or from mounted files (Kubernetes Secret volumes)."""

from __future__ import annotations

import os
from pathlib import Path


def secret(name: str, environ: dict[str, str] | None = None) -> str | None:
    """$NAME, or the contents of the file named by $NAME_FILE (one trailing newline dropped)."""
    environ = dict(os.environ) if environ is None else environ
    if name in environ and f"{name}_FILE" in environ:
        raise ValueError(f"{name} and {name}_FILE are both set: use one")
    if name in environ:
        return environ[name]
    path = environ.get(f"{name}_FILE")
    if path is None:
        return None
    try:
        return Path(path).read_text().removesuffix("\n")
    except OSError as exc:
        raise ValueError(f"{name}_FILE={path}: cannot read it ({exc.strerror})") from None


def secret_list(name: str, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """Several secrets (rotation): comma- or newline-separated."""
    raw = secret(name, environ)
    if raw is None:
        return ()
    return tuple(part.strip() for part in raw.replace("\n", ",").split(",") if part.strip())
