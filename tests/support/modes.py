"""The relay's two sources as a test asks for them. A test's outbox (the `schema` fixture's) is in log mode,
as `postbox migrate` makes a new one, and the relays it starts run in --mode auto, the default, so they read
it in its mode. These marks parametrize the `relay_mode` fixture (indirectly):

- BOTH_MODES: the test runs against each source, log and queue (the relay's contract);
- QUEUE_ONLY: the test needs queue mode (a queue-only statement, or an outbox never switched), and says why;
- LOG_ONLY: the test is about log mode itself, named for whoever reads it (log is the default anyway).
"""

from __future__ import annotations

import pytest

MODES = ("log", "queue")
BOTH_MODES = pytest.mark.parametrize("relay_mode", MODES, indirect=True)
QUEUE_ONLY = pytest.mark.parametrize("relay_mode", ["queue"], indirect=True)
LOG_ONLY = pytest.mark.parametrize("relay_mode", ["log"], indirect=True)
