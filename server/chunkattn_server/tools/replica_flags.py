"""What the flags every replica gets (``make cluster``'s args after ``--``) set that Envoy must follow: their
--max-open-calls, read by the server's own parser so that Envoy's limits and the replicas' never disagree.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence

from chunkattn_server import flags


def max_open_calls(server_args: Sequence[str]) -> int:
    """The --max-open-calls of a replica started with ``server_args`` and this process's environment (which
    the replicas inherit), read by ``chunkattn_server.flags.parse`` as the replica itself will read it:

    - the flag, ``--max-open-calls N`` or ``--max-open-calls=N`` (or an unambiguous prefix; the last one
      given wins), over
    - CHUNKATTN_MAX_OPEN_CALLS in the environment, over
    - "max_open_calls" in the --config file (or the file CHUNKATTN_CONFIG names), over
    - the default, DEFAULT_MAX_OPEN_CALLS.

    0 means no limit. ValueError, with the server's own message, for flags the server would refuse (an
    unknown flag, a config file it cannot read, a value that is not a whole number >= 0).
    """
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            args = flags.parse(list(server_args))
    except SystemExit as e:
        lines = said.getvalue().strip().splitlines()
        why = "they ask for help, not a server" if e.code == 0 else (lines[-1] if lines else f"exit {e.code}")
        raise ValueError(f"the replicas' flags {' '.join(server_args)!r}: {why}") from None
    value = args.max_open_calls
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"the replicas' --max-open-calls must be a whole number >= 0 (0: no limit), got {value!r}")
    return value
