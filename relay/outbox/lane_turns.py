"""When a relay's lane that found nothing looks again: the lanes of one drain, as threads, in step.

A lane whose claim comes up empty does not end its part of the drain while another lane still works:
rows for its shards commit all the time under steady traffic, and a lane that had quit would leave them
waiting until the drain ends (the next lease tick, seconds later). It waits instead until another lane
finishes a batch, then claims again (what the one-thread relay did: every idle lane claimed again each
time a batch was marked). The drain is over when every lane is waiting having seen every batch finished
so far, or has left (stopping, leases due, an error).
"""

from __future__ import annotations

import threading


class LaneTurns:
    def __init__(self, lanes: int) -> None:
        self._lanes = lanes
        self._changed = threading.Condition()
        self._finished = 0  # batches finished in this drain, by any lane
        self._waiting: dict[int, int] = {}  # lane -> batches finished when its claim began
        self._left = 0
        self._over = False

    @property
    def finished(self) -> int:
        """Batches finished so far: read by a lane as its claim begins, passed to `look_again`."""
        return self._finished

    def batch_finished(self) -> None:
        with self._changed:
            self._finished += 1
            self._changed.notify_all()

    def look_again(self, lane: int, seen: int) -> bool:
        """Lane `lane` found nothing in a claim that began after `seen` batches had finished: True when it
        should claim again (another lane finished a batch since), False when the drain is over."""
        with self._changed:
            self._waiting[lane] = seen
            while not self._over and self._finished == seen:
                if self._all_idle():
                    self._over = True
                    self._changed.notify_all()
                    break
                self._changed.wait()
            del self._waiting[lane]
            return not self._over

    def leave(self) -> None:
        """A lane is done with this drain (it may not begin another batch, or it raised)."""
        with self._changed:
            self._left += 1
            if self._all_idle():
                self._over = True
            self._changed.notify_all()

    def _all_idle(self) -> bool:
        return self._left + len(self._waiting) == self._lanes and all(
            seen == self._finished for seen in self._waiting.values()
        )
