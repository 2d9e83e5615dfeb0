"""Is a process on this machine alive? Used to take over, within seconds, work a dead
process still holds (instead of waiting for the watchdog's unresponsive limit or a lease)."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """True when a process with this id runs on this machine (a reused id counts as alive:
    the safe answer, the watchdog still catches the rest)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
