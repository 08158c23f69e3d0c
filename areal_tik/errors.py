"""``UsageError``: a bad value a user typed or put in a YAML.

A ``ValueError`` (so callers that catch ``ValueError`` keep working) whose message names
the value and what is accepted. ``areal-tik`` answers it with one line,
``areal-tik: error: <message>``, and exit status 2 (argparse's status for a bad command
line); any other exception keeps its traceback. This module imports nothing.
"""
from __future__ import annotations


class UsageError(ValueError):
    """A user's input is wrong; the message says which value and what would be accepted."""


def at_least(flag: str, value, minimum) -> None:
    """``value`` (None: not given) is at least ``minimum``; else the one-line answer."""
    if value is not None and value < minimum:
        raise UsageError(f"{flag} must be >= {minimum}, got {value}")
