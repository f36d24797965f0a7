"""The inbox latency benchmark's service (tests/bench/inbox_latency.py): a handler that writes down when it
ran for each message, one `<message id> <time.time()>` line per call to the file that
POSTBOX_BENCH_HANDLED names, and nothing else. The file's first line says which postbox package the
process imported, so the benchmark can check it ran the code it asked for (--inbox-code)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import postbox
from postbox.inbox import Inbox, Message

inbox = Inbox("bench-latency")

# Line-buffered: each line reaches the file when written, so the benchmark can read it while this runs.
_handled = Path(os.environ["POSTBOX_BENCH_HANDLED"]).open("a", buffering=1)  # noqa: SIM115 (the process's life)
_handled.write(f"# code {Path(postbox.__file__).resolve().parent}\n")


@inbox.fallback
def note_time(tx: Any, message: Message) -> None:
    """The time the handler ran, taken first; the claim row the inbox writes is the rest of the effect."""
    at = time.time()
    _handled.write(f"{message.message_id} {at}\n")
