"""Asking a running postbox process over HTTP: http_get (its /healthz, /readyz and /metrics answers) and
metric_value (one sample of the Prometheus text)."""

from __future__ import annotations


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of GET http://127.0.0.1:port/path; a non-2xx answer is returned, not raised, and
    status 0 means nothing answered."""
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError as error:  # not listening (yet), reset, timed out
        return 0, str(error)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus exposition text (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        metric, _, label_text = sample.partition("{")
        found = ",".join(sorted(label_text.rstrip("}").split(","))) if label_text else ""
        if metric == name and found == wanted:
            return float(value)
    return 0.0
