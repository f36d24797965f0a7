"""A text waterfall of one trace from the spans an OTLP receiver decoded (tests/otlp.py): each span under
its parent, a bar where it ran on the trace's clock, its duration and its events. The picture of a trace
in docs/how-to/tracing.md is this output (tests/integration/test_tracing.py writes it to
POSTBOX_TRACE_WATERFALL when set)."""

from __future__ import annotations

from collections.abc import Sequence

from tests.otlp import ReceivedSpan

_NAME_WIDTH = 44


def tree(spans: Sequence[ReceivedSpan]) -> list[tuple[int, ReceivedSpan]]:
    """(depth, span) in drawing order: parents before children, siblings by start time. A span whose
    parent is not among them (the trace's root, or one whose parent was not exported) starts a tree."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        children.setdefault(span.parent_span_id if span.parent_span_id in ids else "", []).append(span)
    ordered: list[tuple[int, ReceivedSpan]] = []

    def walk(parent: str, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s.start_ns):
            ordered.append((depth, span))
            walk(span.span_id, depth + 1)

    walk("", 0)
    return ordered


def render(spans: Sequence[ReceivedSpan], width: int = 40) -> str:
    """The waterfall of one trace's spans: a line each, in tree order, with a bar on the trace's clock."""
    if not spans:
        return "(no spans)\n"
    start = min(s.start_ns for s in spans)
    total = max(max(s.end_ns for s in spans) - start, 1)
    service_width = max(len(s.service) for s in spans)
    lines = [
        f"trace {spans[0].trace_id}: {len(spans)} spans, {total / 1e6:.1f} ms",
        f"{'service':{service_width}}  {'span':{_NAME_WIDTH}} {'kind':9} "
        f"|{'0 ms':<{width // 2}}{f'{total / 1e6:.0f} ms':>{width - width // 2}}|",
    ]
    for depth, span in tree(spans):
        first = int((span.start_ns - start) / total * width)
        last = max(first + 1, round((span.end_ns - start) / total * width))
        bar = "." * first + "#" * (last - first) + "." * (width - last)
        name = ("  " * depth + span.name)[:_NAME_WIDTH]
        events = "".join(f"  <{event}>" for event, _ in span.events)
        lines.append(
            f"{span.service:{service_width}}  {name:{_NAME_WIDTH}} {span.kind:9} |{bar[:width]}| "
            f"{(span.end_ns - span.start_ns) / 1e6:7.1f} ms{events}"
        )
    return "\n".join(lines) + "\n"
