"""The live status page every peer serves at ``/`` (see docs/status.md).

``timeline`` records bounded time series and per-peer link stats; ``report`` builds the summary and
/api/status from the peer (read only); ``routes`` serves the page, its
static assets, ``/api/events`` (server-sent events) and ``/metrics`` (Prometheus text format).
"""

from .timeline import Series, Timeline

__all__ = ["Series", "Timeline"]
