"""A compiler_fn for the sweep's worker tests, in a module spawned workers import by its plain name.

A function defined in a test module would be pickled by the test module's
name, which pytest's importlib mode derives from the repository layout
(``packages.ca-testkit.tests...``); a spawned worker can import that only
when its working directory happens to be the repository root.
"""

from __future__ import annotations

import os
import signal
import time


def stalling_once_compiler(gm):
    """In the one process that takes a marker file first: sleep (the timer
    interrupts it) or block SIGALRM and sleep (only a kill ends it)."""
    for var, block in (("CA_SWEEP_TEST_SLEEP", False), ("CA_SWEEP_TEST_BLOCK", True)):
        path = os.environ.get(var)
        if not path:
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        if block:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
    return gm
