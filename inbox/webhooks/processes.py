"""Several receiver processes on one port (`postbox inbox serve --workers N`).

One receiver process is bound by its own Python: one core at most. Here the parent binds the port once
and starts N processes that each accept on that socket and run a whole receiver (its own event loop and
database pool); the kernel hands each new connection to one of them. The parent serves nothing on the
webhook port. It:
- restarts a process that dies (with backoff, logged), so the port never stops answering while one
  process is left;
- serves the metrics port for all of them: the processes write their counters to files in a private
  directory (prometheus_client's multiprocess mode) and the parent adds them up, so one scrape sees the
  whole receiver, and a restarted process's counts are kept;
- on SIGTERM or SIGINT asks each process to stop gracefully (uvicorn finishes the requests in flight,
  each of which answers only after its commit), waits, and exits 0 once they all have;
- dies without leaving them behind: each process stops by itself once its parent is gone.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from postbox.relay.core import ops_http
from postbox.relay.core.backoff import backoff_delay

log = structlog.get_logger("postbox.webhooks")

Check = ops_http.Check  # the probes the metrics port answers
# Runs one receiver on the listening socket until it is told to stop; called in a fresh interpreter
# (spawn), so it must be picklable: a module-level function, or a functools.partial of one.
Target = Callable[[socket.socket], None]
STOP_SECONDS = 30.0  # for the processes' graceful stop before they are killed
MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"


def listening_socket(host: str, port: int) -> socket.socket:
    """The webhook port, bound once by the parent (a port in use fails the start here, clearly)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@contextmanager
def shared_metrics() -> Iterator[CollectorRegistry]:
    """A registry adding up the metrics every receiver process writes, for the life of the block. The
    directory is set in the environment, which the processes started inside the block inherit;
    prometheus_client reads it when they import it."""
    directory = tempfile.mkdtemp(prefix="postbox-receiver-metrics-")
    before = os.environ.get(MULTIPROC_DIR)
    os.environ[MULTIPROC_DIR] = directory
    try:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
        yield registry
    finally:
        if before is None:
            os.environ.pop(MULTIPROC_DIR, None)
        else:
            os.environ[MULTIPROC_DIR] = before
        shutil.rmtree(directory, ignore_errors=True)


class ReceiverProcesses:
    def __init__(self, target: Target, sock: socket.socket, count: int, database_ready: Check) -> None:
        self._target = target
        self._socket = sock
        self._database_ready = database_ready
        self._context = multiprocessing.get_context("spawn")  # a clean interpreter: no inherited threads
        self._processes: list[BaseProcess | None] = [None] * count
        self._stopping = threading.Event()

    def install_signal_handlers(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self._stopping.set())

    def healthy(self) -> tuple[bool, str]:
        alive = sum(1 for p in self._processes if p is not None and p.is_alive())
        return alive > 0, f"{alive} of {len(self._processes)} receiver processes running"

    def ready(self) -> tuple[bool, str]:
        """Ready while every process runs and the database answers (as a single receiver's /readyz)."""
        running, how = self.healthy()
        if not running or any(p is None or not p.is_alive() for p in self._processes):
            return False, how
        return self._database_ready()

    def run(self) -> int:
        """Start the processes, keep them running until SIGTERM or SIGINT, stop them; 0 if every one
        stopped cleanly."""
        restarts = [0] * len(self._processes)
        for index in range(len(self._processes)):
            self._start(index)
        while not self._stopping.wait(0.5):
            for index, process in enumerate(self._processes):
                if process is None or process.is_alive() or self._stopping.is_set():
                    continue
                restarts[index] += 1
                delay = backoff_delay(restarts[index] - 1, base=0.5, cap=10.0)
                log.error(
                    "receiver_process_exited",
                    process=index,
                    exit_code=process.exitcode,
                    restart_in_seconds=round(delay, 2),
                )
                if not self._stopping.wait(delay):
                    self._start(index)
        return self._stop_all()

    def _start(self, index: int) -> None:
        process = self._context.Process(
            target=_run_child, args=(self._target, self._socket, os.getpid()), name=f"receiver-{index}"
        )
        process.start()
        self._processes[index] = process
        log.info("receiver_process_started", process=index, pid=process.pid)

    def _stop_all(self) -> int:
        running = [p for p in self._processes if p is not None and p.is_alive()]
        for process in running:
            if process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)
        clean = True
        for process in running:
            process.join(STOP_SECONDS)
            if process.is_alive():
                log.error("receiver_process_killed", pid=process.pid, after_seconds=STOP_SECONDS)
                process.kill()
                process.join()
            # SIGTERM before uvicorn's handlers are in place (a process still starting) ends it by the
            # signal: that is the stop asked for too.
            if process.exitcode not in (0, -signal.SIGTERM):
                log.error("receiver_process_failed_to_stop", pid=process.pid, exit_code=process.exitcode)
                clean = False
        self._socket.close()
        return 0 if clean else 1


def _run_child(target: Target, sock: socket.socket, parent: int) -> None:
    _stop_when_orphaned(parent)
    target(sock)


def _stop_when_orphaned(parent: int) -> None:
    """SIGTERM this process once its parent is gone (killed with SIGKILL, say): a receiver whose parent
    died would otherwise keep taking requests with nobody to restart or scrape it."""

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()
