"""Errors a user can fix or catch, importable without torch. The command line catches them to
print one line instead of a traceback, before it imports torch.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, ContextManager, Iterator

__all__ = ["CheckpointError", "MissingDataError", "NonFiniteLoss", "Interrupted", "interrupt_on_signals"]

#: the signals that stop a run: Ctrl-C, kill's default, a closed terminal
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))
#: whether this platform can block signals on every thread and wait for them on one (POSIX; not Windows)
CAN_WAIT_SIGNALS = hasattr(signal, "sigwaitinfo") and hasattr(signal, "pthread_sigmask")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and why."""


class MissingDataError(RuntimeError):
    """A data set or a package it comes from is not installed; the message names the fix."""


class NonFiniteLoss(RuntimeError):
    """Training produced a NaN or infinite loss."""


class Interrupted(KeyboardInterrupt):
    """A signal stopped the run: SIGINT (Ctrl-C), SIGTERM or SIGHUP. The message, if any, says
    what was stopped and how to resume; the command line prints it as one line and exits with
    128 + the signal's number (130, 143, 129). A KeyboardInterrupt, so that ``except Exception``
    on the way up lets it through and code that handles Ctrl-C handles it."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message)
        self.signum = int(signum)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def interrupt_on_signals() -> ContextManager[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` in the main
    thread (SIGTERM would otherwise end the process with no word, and SIGINT raise a bare
    KeyboardInterrupt); see :func:`signals_handled`."""

    def handler(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    return signals_handled(handler)


@contextlib.contextmanager
def signals_handled(handler: Any) -> Iterator[None]:
    """Within the block, :data:`STOP_SIGNALS` go to ``handler`` (a function, or ``signal.SIG_IGN``);
    the previous handlers come back after. Outside the main thread it does nothing (only the
    main thread may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, previous in saved.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
