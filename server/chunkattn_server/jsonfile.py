"""The server's JSON files (the token file, --kv-scales, --config), read strictly: a key given twice in one
object is an error to report, where JSON readers quietly keep the last (a tenant listed twice would lose its
first entry, a repeated quota its first value)."""

from __future__ import annotations

import json
from collections import Counter
from typing import IO, Any


class _Object(dict[str, Any]):
    """A JSON object as read (json.load's object_pairs_hook), with the keys it gives more than once."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.repeated = [key for key, n in Counter(key for key, _ in pairs).items() if n > 1]


def load(f: IO[str]) -> Any:
    """json.load of ``f``; ValueError (json.JSONDecodeError) when it is not JSON, and ValueError naming the
    first key given twice in one object and where (``'max_calls' is given twice in 'tenants' > 'a'``)."""
    data = json.load(f, object_pairs_hook=_Object)
    problem = _repeated(data, [])
    if problem:
        raise ValueError(f"{problem}; give each once (JSON readers keep only the last)")
    return data


def _repeated(value: Any, path: list[str]) -> str | None:
    """The first key given twice in ``value`` or in what it holds, with where; None when none is."""
    where = "in " + " > ".join(path) if path else "at the top level"
    if isinstance(value, _Object):
        if value.repeated:
            return f"{value.repeated[0][:70]!r} is given twice {where}"
        items: Any = ((repr(k[:70]), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for name, item in items:
        problem = _repeated(item, [*path, name])
        if problem:
            return problem
    return None
