"""Progress lines of the benchmarks: on stderr, stamped, so the table on stdout stays clean to pipe."""
from __future__ import annotations

import sys
import time
from typing import Callable


def progress_for(tag: str) -> Callable[[str], None]:
    """A printer of `[tag HH:MM:SS] message` lines."""
    def say(msg: str) -> None:
        print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    return say
