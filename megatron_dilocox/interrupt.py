"""Ctrl-C as a request to stop: the training loop stops at its next iteration boundary.

Raising KeyboardInterrupt from the signal handler itself lands wherever the main thread happens
to be, and a library that catches broad exceptions there (a checkpoint writer's join, a process
group call) can swallow it, leaving a run that trains on after its Ctrl-C. A flag the loop checks
cannot be lost. Under torchrun a rank sees Ctrl-C twice within milliseconds (the terminal's, then
torchrun's forwarded copy); a Ctrl-C more than ``FORCE_AFTER_S`` after the first one stops at once.
"""
import os
import signal
import threading
import time

FORCE_AFTER_S = 2.0
"""A second Ctrl-C this many seconds after the first raises KeyboardInterrupt where the run is."""

requested = threading.Event()
"""Set by the first Ctrl-C."""


def install() -> None:
    """Handles SIGINT in this process (forked children, e.g. checkpoint writers, ignore it)."""
    main, first = os.getpid(), []

    def on_sigint(signum, frame):
        if os.getpid() != main:  # a forked checkpoint writer: its parent stops it
            return
        now = time.monotonic()
        if not first:
            first.append(now)
            requested.set()
        elif now - first[0] > FORCE_AFTER_S:
            _stop_now()

    signal.signal(signal.SIGINT, on_sigint)


def check() -> None:
    """Raises KeyboardInterrupt once Ctrl-C was pressed (call from the main thread)."""
    if requested.is_set():
        _stop_now()


def _stop_now() -> None:
    # From here the run is stopping: a later Ctrl-C (or torchrun's copy, whose handler can run
    # seconds late when the main thread was busy in C code) must not cut the shutdown short, and
    # the interpreter would die of it during finalization (exit by SIGINT instead of 130).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt
