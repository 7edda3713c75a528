"""What ``ps``, ``top`` and /proc/PID/cmdline show for a process minifaas starts: ``minifaas ROLE ...``.

Every entry point calls ``set_title``. The title is written over the process's own command line, so a longer
one is cut short; the environment stays where it was.
"""

from __future__ import annotations

import functools
import os

import setproctitle

NO_ENVIRONMENT = "SPT_NOENV"  # read by setproctitle once, at its first title: keep off the environment's memory


def set_title(*words: object) -> None:
    """Show ``minifaas WORDS...`` as this process's command line; empty words are left out."""
    _initialised()
    setproctitle.setproctitle(" ".join(["minifaas", *(str(w) for w in words if w not in ("", None))]))


@functools.cache
def _initialised() -> None:
    """setproctitle's first call, made with ``SPT_NOENV`` set; the environment is left as it was."""
    before = os.environ.get(NO_ENVIRONMENT)
    os.environ[NO_ENVIRONMENT] = "1"
    try:
        setproctitle.getproctitle()
    finally:
        if before is None:
            del os.environ[NO_ENVIRONMENT]
        else:
            os.environ[NO_ENVIRONMENT] = before
