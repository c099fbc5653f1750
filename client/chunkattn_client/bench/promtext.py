"""Reading the server's /metrics page (Prometheus text format 0.0.4) without prometheus_client.

Only what the bench needs: every sample's name, labels and value. Comments and HELP/TYPE lines are
skipped; label values may hold escaped quotes, backslashes and newlines.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Mapping

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


class MetricsError(RuntimeError):
    """The metrics page could not be fetched or read."""


def parse(text: str) -> Samples:
    """{(name, sorted labels): value} of every sample on the page."""
    samples: Samples = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise MetricsError(f"line {n} of the metrics page does not parse: {line[:120]!r}")
        name, labels_text, value = m.groups()
        labels: list[tuple[str, str]] = []
        pos = 0
        text_l = labels_text or ""
        while pos < len(text_l):
            lm = _LABEL.match(text_l, pos)
            if lm is None:
                raise MetricsError(f"line {n}: bad labels {text_l!r}")
            labels.append((lm.group(1), re.sub(r"\\[\\\"n]", lambda e: _UNESCAPE[e.group(0)], lm.group(2))))
            pos = lm.end()
        samples[(name, tuple(sorted(labels)))] = float(value)
    return samples


def fetch(url: str, timeout_s: float = 5.0) -> Samples:
    """Scrape ``url`` once."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return parse(r.read().decode("utf-8"))
    except OSError as e:
        raise MetricsError(f"could not scrape {url}: {e}") from None


def total(samples: Samples, name: str, **match: str) -> float:
    """The sum of ``name``'s samples whose labels include ``match`` (0 when there are none)."""
    want = set(match.items())
    return sum(v for (n, labels), v in samples.items() if n == name and want <= set(labels))


def delta(after: Samples, before: Mapping[tuple[str, Labels], float], name: str, **match: str) -> float:
    """How much a counter grew between two scrapes."""
    return total(after, name, **match) - total(dict(before), name, **match)


def label_values(samples: Samples, name: str, label: str) -> set[str]:
    """The values ``label`` takes among ``name``'s samples."""
    return {dict(labels)[label] for (n, labels) in samples if n == name and label in dict(labels)}
