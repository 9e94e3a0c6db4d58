"""What peers make a loopback server log, bounded: refused requests, connections the peer cut and
failed requests are counted by kind, :data:`LOG_BURST` of each kind logged per
:data:`LOG_WINDOW_S`, and the rest summed up in one line, so that no local process can fill the
log at will."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Optional

LOG_BURST = 3
"""Log lines per kind of peer event (refused request, cut connection, failed request) and
:data:`LOG_WINDOW_S`; the rest of the window's events of that kind are summed up in one line."""
LOG_WINDOW_S = 60.0


class PeerEvents:
    """Counts what peers make the server log (``counts``, by kind) and logs it boundedly:
    :data:`LOG_BURST` lines per kind and :data:`LOG_WINDOW_S`, then one line per kind with the
    number of the window's events not logged one by one (at the next event after the window,
    or at :meth:`summarise`)."""

    def __init__(
        self, logger: logging.Logger, burst: int = LOG_BURST, window_s: float = LOG_WINDOW_S
    ):
        self.logger = logger
        """Where the lines go: the server's own logger."""
        self.burst = burst
        self.window_s = window_s
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._window_start = time.monotonic()
        self._logged: collections.Counter[str] = collections.Counter()
        self._unlogged: collections.Counter[str] = collections.Counter()

    def note(self, kind: str, level: int, message: str, *args: Any, exc_info: bool = False) -> None:
        """Count one event of ``kind``; log ``message % args`` unless the window's burst of that
        kind is spent (``exc_info``: with the traceback being handled)."""
        with self._lock:
            self._roll_window(force=False)
            self.counts[kind] += 1
            log = self._logged[kind] < self.burst
            if log:
                self._logged[kind] += 1
            else:
                self._unlogged[kind] += 1
        if log:
            self.logger.log(level, message, *args, exc_info=exc_info)

    def summarise(self) -> None:
        """Log what the current window did not log one by one, and start a new window."""
        with self._lock:
            self._roll_window(force=True)

    def _roll_window(self, *, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._window_start < self.window_s:
            return
        for kind, count in sorted(self._unlogged.items()):
            self.logger.warning(
                "embedded server: %d more %s in the last %.0f s, not logged one by one",
                count,
                kind,
                now - self._window_start,
            )
        self._window_start = now
        self._logged.clear()
        self._unlogged.clear()


def peer_cut(error: Optional[BaseException]) -> bool:
    """Whether ``error`` means the peer went away (reset, broken pipe, time-out): nothing this
    server did wrong, and nobody left to answer."""
    return isinstance(error, (ConnectionError, TimeoutError))
