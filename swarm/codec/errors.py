"""The single error type the codec raises for bad input."""

from __future__ import annotations


class CodecError(ValueError):
    """A payload (or codec state) is malformed, hostile, or meant for another model.

    Subclasses ValueError so a web handler can map every decode failure to one 400
    without catching unrelated bugs; all parser exceptions are wrapped into it.
    """
