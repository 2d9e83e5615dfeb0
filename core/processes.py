"""Is a process on this machine alive? Used to take over, within seconds, work a dead
process still holds (instead of waiting for the watchdog's unresponsive limit or a lease)."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """True when a process with this id runs on this machine (a reused id counts as alive:
    the safe answer, the watchdog still catches the rest). A zombie is dead: a worker killed
    with -9 together with its pool processes leaves them as zombies until whoever inherits
    them reaps them (a second or more under some init processes), and a worker restarted in
    that time must take their work over, not wait for a lease."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Linux: /proc/<pid>/stat says Z (zombie) or X (dead). Elsewhere: no way to tell, so not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read()
    except OSError:
        return False
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")".
    state = fields[fields.rfind(b")") + 1 :].split()[:1]
    return state in ([b"Z"], [b"X"])
