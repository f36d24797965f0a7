"""postbox as real child processes (so SIGKILL, SIGSTOP and SIGTERM are the real thing): ChildProcess,
and the relay, inbox consumer, webhook worker and webhook receiver on top of it (RelayProcess,
InboxProcess, WorkerProcess, ReceiverProcess); relay_run_args is the `relay run` command line a test
starts a relay with (server_args, the flags that name its servers), followed_modes reads a relay's log,
and postbox_cli (inbox_cli: `postbox inbox ...`) runs a command once, as a user would."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Self

from postbox.relay.devstack.ports import free_port
from tests.support.repo import REPO
from tests.support.waiting import wait_until
from tests.support.webhooks import MARQETA_AUTH, MARQETA_SECRET, SHOPIFY_SECRET, STRIPE_SECRET


class ChildProcess:
    """A `postbox ...` command as a real child process (so SIGKILL, SIGSTOP and SIGTERM are the real thing),
    its JSON logs in a file under /tmp."""

    def __init__(
        self,
        name: str,
        args: list[str],
        env: dict[str, str] | None = None,
        log_level: str = "debug",
        open_files: int | None = None,
        program: tuple[str, ...] = (sys.executable, "-m", "postbox"),
        cwd: Path = REPO,
    ) -> None:
        self.log_path = Path(f"/tmp/postbox-test-{name}.log")
        self._log = self.log_path.open("ab")
        command = [*program, "--log-format", "json", "--log-level", log_level, *args]
        if open_files is not None:  # soft and hard limit both, so the process cannot raise it back
            command = ["prlimit", f"--nofile={open_files}:{open_files}", "--", *command]
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd, env={**os.environ, **(env or {})}
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def process_tree(self) -> list[int]:
        """This process's id and its descendants' (a receiver with --workers forks its workers)."""
        found, index = [self.process.pid], 0
        while index < len(found):
            with contextlib.suppress(OSError):
                for task in Path(f"/proc/{found[index]}/task").iterdir():
                    found.extend(int(c) for c in (task / "children").read_text().split())
            index += 1
        return found

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (after SIGCONT, in case it is paused) and its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=10)
        self._log.close()


def server_args(database_url: str, bootstrap: str, schema: str) -> list[str]:
    """The flags that name the database, the brokers and the schema of a relay or an inbox consumer."""
    return ["--database-url", database_url, "--kafka-bootstrap", bootstrap, "--schema", schema]


def relay_run_args(
    database_url: str, bootstrap: str, schema: str, metrics_port: int, *extra: str
) -> list[str]:
    """The arguments of `postbox relay run` on these servers and schema, its metrics port on 127.0.0.1,
    polling every 0.2 s; `extra` after them (a flag given again there wins)."""
    return [
        "relay",
        "run",
        *server_args(database_url, bootstrap, schema),
        "--metrics-address",
        f"127.0.0.1:{metrics_port}",
        "--poll-interval",
        "0.2",
        *extra,
    ]


class RelayProcess(ChildProcess):
    """`postbox relay run` with short leases and polls, for tests."""

    def __init__(
        self,
        database_url: str,
        bootstrap: str,
        schema: str,
        *extra: str,
        relay_id: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.relay_id = relay_id or f"relay-{uuid.uuid4().hex[:6]}"
        self.metrics_port = free_port()
        super().__init__(
            f"{self.relay_id}-{uuid.uuid4().hex[:6]}",  # replicas may share a relay id, never a log
            relay_run_args(
                database_url,
                bootstrap,
                schema,
                self.metrics_port,
                "--relay-id",
                self.relay_id,
                "--lease-ttl",
                "3",
                *extra,
            ),
            env,
        )


def followed_modes(relay: RelayProcess) -> list[str]:
    """The modes a relay started with --mode auto ran in, in order (its relay_mode_followed events)."""
    import json  # noqa: PLC0415

    lines = relay.log().splitlines()
    return [str(json.loads(line)["mode"]) for line in lines if "relay_mode_followed" in line]


class InboxProcess(ChildProcess):
    """`postbox inbox consume` with a test app."""

    def __init__(
        self,
        database_url: str,
        bootstrap: str,
        schema: str,
        app: str,
        topics: list[str],
        *extra: str,
        env: dict[str, str] | None = None,
        log_level: str = "debug",
    ) -> None:
        self.metrics_port = free_port()
        super().__init__(
            f"inbox-{uuid.uuid4().hex[:6]}",
            [
                "inbox",
                "consume",
                "--metrics-address",
                f"127.0.0.1:{self.metrics_port}",
                "--app",
                app,
                *server_args(database_url, bootstrap, schema),
                "--topics",
                ",".join(topics),
                # A killed member leaves the group after this (Kafka's default is 45 s).
                "--kafka-config",
                "session.timeout.ms=6000",
                *extra,
            ],
            env,
            log_level,
        )


class WorkerProcess(ChildProcess):
    """`postbox inbox work` with the test webhook app, reaping quickly."""

    def __init__(self, database_url: str, schema: str, env: dict[str, str] | None = None) -> None:
        self.metrics_port = free_port()
        super().__init__(
            f"worker-{uuid.uuid4().hex[:6]}",
            [
                "inbox",
                "work",
                "--app",
                "tests.apps.hooks:hooks",
                "--database-url",
                database_url,
                "--schema",
                schema,
                "--poll-interval",
                "0.1",
                "--reap-interval",
                "0.5",
                "--metrics-address",
                f"127.0.0.1:{self.metrics_port}",
            ],
            env,
        )


class ReceiverProcess(ChildProcess):
    """`postbox inbox serve` (uvicorn), with the test providers configured, once it answers."""

    def __init__(
        self,
        database_url: str,
        schema: str,
        *extra: str,
        log_level: str = "debug",
        open_files: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **(env or {}),
            "POSTBOX_WEBHOOK_STRIPE_SECRETS": STRIPE_SECRET,
            "POSTBOX_WEBHOOK_SHOPIFY_SECRETS": SHOPIFY_SECRET,
            "POSTBOX_WEBHOOK_MARQETA_USERNAME": MARQETA_AUTH[0],
            "POSTBOX_WEBHOOK_MARQETA_PASSWORD": MARQETA_AUTH[1],
            "POSTBOX_WEBHOOK_MARQETA_SECRET": MARQETA_SECRET,
        }
        super().__init__(
            f"receiver-{self.port}",
            [
                "inbox",
                "serve",
                "--database-url",
                database_url,
                "--schema",
                schema,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *extra,
            ],
            env,
            log_level,
            open_files,
        )
        wait_until(lambda: self.process.poll() is not None or self._answers(), 30, what="the receiver")
        assert self.process.poll() is None, self.log()

    def serving_pids(self) -> list[int]:
        """The processes that serve requests: this one, or with --workers the ones it started
        (multiprocessing's spawn; its resource tracker, also a child, serves nothing)."""
        started = []
        for pid in self.process_tree()[1:]:
            with contextlib.suppress(OSError):  # gone since the listing
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    started.append(pid)
        return started or [self.process.pid]

    def _answers(self) -> bool:
        import urllib.request  # noqa: PLC0415

        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def post(self, provider: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, object]]:
        import json  # noqa: PLC0415
        import urllib.error  # noqa: PLC0415
        import urllib.request  # noqa: PLC0415

        request = urllib.request.Request(
            f"{self.url}/webhooks/{provider}",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", **headers},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}")


def postbox_cli(
    servers: Any, schema: str, *args: str, check: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`postbox ARGS` on the test's schema, once, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "postbox", *args, "--database-url", servers.database_url, "--schema", schema],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=check,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def inbox_cli(
    servers: Any, schema: str, *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`postbox inbox ARGS` on the test's schema, as a user runs it."""
    return postbox_cli(servers, schema, "inbox", *args, check=check, env=env)
