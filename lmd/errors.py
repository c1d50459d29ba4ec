"""The one exception type the CLI prints as a single line (no traceback unless LMD_DEBUG=1)."""

from __future__ import annotations


class LmdError(Exception):
    """A problem the user can fix: the message names what is wrong and how to fix it."""
