"""Run one fuzz target under atheris (libFuzzer underneath), with the project's modules instrumented.

    python -m tests.fuzz.run stripe -atheris_runs=200000          # a bounded run
    python -m tests.fuzz.run message_id -max_total_time=600        # ten minutes
    python -m tests.fuzz.run --list

Any other argument goes to libFuzzer (-seed=, -max_len=, a corpus folder...). A crash prints the Python
traceback and writes the input to crash-<sha1>; replay it with `python -m tests.fuzz.run TARGET crash-...`.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["inbox", "relay"]):
    from tests.fuzz.targets import TARGETS


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        print(f"usage: python -m tests.fuzz.run {{{','.join(TARGETS)}}} [libFuzzer options]", file=sys.stderr)
        raise SystemExit(0 if "--list" in sys.argv else 2)
    target = TARGETS[sys.argv[1]]
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
