"""A call's entries as the engine's side takes them: checked once, where they are built.

``Entries`` is a tuple of ``BatchEntry`` that only exists checked (``checks.check_entries`` runs when one is
made), so whatever takes one (``Scheduler.attend``, the step queue's rules) may rely on its ids being
distinct valid strings and its positions and token counts valid integers, without checking again. The
service builds one per request where it parses it (off the event loop for a large request); an in-process
caller's list is checked on submission.
"""

from __future__ import annotations

from collections.abc import Iterable

from chunkattn_client.batch import BatchEntry
from chunkattn_server.engine import checks


class Entries(tuple[BatchEntry, ...]):
    """A call's entries, checked (InvalidBatch, as ``checks.check_entries`` raises, when they are not)."""

    __slots__ = ()

    def __new__(cls, entries: Iterable[BatchEntry]) -> Entries:
        items = super().__new__(cls, entries)
        checks.check_entries(items)
        return items


def checked(entries: Iterable[BatchEntry]) -> Entries:
    """``entries`` as Entries: as they are when they are already, else checked now."""
    return entries if isinstance(entries, Entries) else Entries(entries)
