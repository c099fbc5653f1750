"""Block YAML for plain JSON-like data (dicts, lists, strings, numbers, booleans, None): what
``deploy/envoy/envoy.yaml`` is written with. Nothing else; no dependency on a YAML library.

Strings are double-quoted as JSON writes them (valid YAML), keys are bare when they are words, and an empty
dict or list is written inline ({} or []).
"""

from __future__ import annotations

import json
from typing import Any


def dump(value: Any) -> str:
    """``value`` as block YAML, one line per scalar, ending with a newline."""
    return "\n".join(_lines(value)) + "\n"


def _lines(value: Any, indent: str = "") -> list[str]:
    if isinstance(value, dict):
        lines = []
        for k, v in value.items():
            key = k if k.replace("_", "").isalnum() else json.dumps(k)
            if isinstance(v, (dict, list)) and v:
                lines += [f"{indent}{key}:", *_lines(v, indent + "  ")]
            else:
                lines.append(f"{indent}{key}: {_scalar(v)}")
        return lines
    if isinstance(value, list):
        lines = []
        for item in value:
            inner = _lines(item, indent + "  ")
            lines += [f"{indent}- {inner[0].lstrip()}", *inner[1:]]
        return lines
    return [f"{indent}{_scalar(value)}"]


def _scalar(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return "{}" if isinstance(v, dict) else "[]"
    return json.dumps(v)  # true/false, null, numbers, "strings"
