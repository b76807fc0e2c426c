"""How a process of a distributed run ends: at once on a signal, and by itself when the process
that started it dies.

A stage process is started by torchrun's agent (``torchrun``, or ``pipeoptim train --runtime
distributed``, which runs that agent in-process) in a session of its own: a terminal's Ctrl-C
reaches only the launcher, which forwards it, and a launcher killed outright (SIGKILL, the
out-of-memory killer) forwards nothing. :func:`guard` installs two guards, first thing in the
process, before any other thread starts:

* **Signals.** SIGINT, SIGTERM and SIGHUP are blocked in every thread and taken by one watcher
  thread (``sigwaitinfo``), so they act at once even while the main thread waits inside gloo or
  NCCL (a Python handler would run only when the main thread next runs Python code). The
  watcher tells who sent the signal (:class:`Stop`), calls ``on_stop`` and ends the process
  with ``os._exit(128 + signal)``: no traceback, no interpreter teardown (gloo's threads can
  abort it), the last complete checkpoint untouched (checkpoints are written to temporary
  names and renamed). Without ``sigwaitinfo`` (not Linux), handlers in the main thread do it.
* **The parent's death.** ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (through ctypes) has the kernel
  send SIGTERM when the parent dies, taken as above; without prctl a daemon thread checks every
  0.25 s whether the parent is still the process that started this one.

And how it starts again: torchrun's agent restarts every worker of a failed job with the same
command line (``--max-restarts``), and by default the workers of every start share the agent's
store, which still holds the keys the process groups of the earlier starts left (their peers'
addresses, gone). :func:`fresh_join` gives each join of the job's process group a number no other
join over that store has used, the same on every rank, to rendezvous under.

Imports nothing of pipeoptim: the launcher and any script under torchrun can use it.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

from ..errors import CAN_WAIT_SIGNALS, STOP_SIGNALS

#: the signal the kernel sends a stage when its parent dies (prctl)
PARENT_DEATH_SIGNAL = signal.SIGTERM
POLL_SECONDS = 0.25
_PR_SET_PDEATHSIG = 1
_PF_EXITING = 0x4  #: a task's flag in /proc/PID/stat while it exits


#: how this process's guards were installed (None: not yet), ``"<signals>+<parent>"``: ``sigwait``,
#: ``handler`` or ``none``; ``prctl`` or ``poll`` (one per process, as signal handlers are)
_installed: Optional[str] = None


def under_torchrun() -> bool:
    """True in a process started by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass(frozen=True)
class Stop:
    """Why this process is stopping.

    ``cause`` is ``"launcher"`` (the parent sent the signal: a launcher forwarding Ctrl-C or
    SIGTERM, or stopping the run because another stage failed), ``"signal"`` (someone else sent it)
    or ``"parent-died"`` (the process that started this one is gone)."""

    signum: int
    cause: str
    sender: Optional[int] = None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def set_parent_death_signal(signum: int = PARENT_DEATH_SIGNAL) -> bool:
    """Ask Linux to send ``signum`` to this process when its parent dies; False where that is
    not available (not Linux, no libc, prctl refused)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def parent_gone(parent: int) -> bool:
    """Has the process ``parent`` died, or begun to (this process was handed to another, or
    ``parent`` is a zombie, gone, or exiting)?"""
    if os.getppid() != parent:
        return True
    try:
        fields = open(f"/proc/{parent}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return os.path.isdir("/proc/self")  # no such process; without /proc, only the test above
    return fields[0] in ("Z", "X", "x") or bool(int(fields[6]) & _PF_EXITING)


def guard(on_stop: Callable[[Stop], None] = lambda stop: None, *, parent: Optional[int] = None,
          use_prctl: bool = True) -> str:
    """Install both guards in this process (call it from the main thread, before other threads
    start: only threads started afterwards inherit the blocked signals; a second call does nothing,
    the first is kept; from another thread only the parent is watched).
    ``parent`` is the pid of the process that started this one (default: the current parent; a
    launcher that knows better passes its own pid, so that a parent already gone is noticed).
    ``on_stop`` runs in the watcher thread just before the process ends; keep it short (write a
    status, print a line) and free of imports. Returns how the parent is watched, ``"prctl"`` or
    ``"poll"``."""
    global _installed
    if _installed is not None:
        return _installed.split("+")[1]
    parent = os.getppid() if parent is None else parent
    once = threading.Lock()

    def stop(reason: Stop) -> None:
        if not once.acquire(blocking=False):  # another thread is already ending the process
            while True:
                time.sleep(60)
        try:
            on_stop(reason)
        except BaseException:  # noqa: BLE001 - the process ends regardless
            pass
        finally:
            os._exit(reason.exit_code)

    def cause_of(sender: Optional[int]) -> str:
        if sender != parent:
            return "parent-died" if parent_gone(parent) else "signal"
        # The parent's pid on the signal: forwarded by a live launcher, or the kernel's
        # parent-death signal (sent as from the dying parent, while it still has that pid).
        deadline = time.monotonic() + 0.05
        while not parent_gone(parent):
            if time.monotonic() > deadline:
                return "launcher"
            time.sleep(0.005)
        return "parent-died"

    how_signals = "none"  # (only the main thread may set handlers and block signals for the rest)
    if threading.current_thread() is threading.main_thread():
        # Handlers first: where signals cannot be waited for, and for a signal that lands on a
        # thread started before the guard (not blocked there), they stop the process when the
        # main thread next runs Python code; the sender is not known there.
        for signum in STOP_SIGNALS:
            signal.signal(signum, lambda s, frame: stop(Stop(s, cause_of(None))))
        how_signals = "handler"
        if CAN_WAIT_SIGNALS:
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # this thread and those it starts

            def watch_signals() -> None:
                while True:
                    info = signal.sigwaitinfo(STOP_SIGNALS)
                    sender = info.si_pid or None
                    stop(Stop(info.si_signo, cause_of(sender), sender))

            threading.Thread(target=watch_signals, name="pipeoptim-signals", daemon=True).start()
            how_signals = "sigwait"

    how = "prctl" if use_prctl and set_parent_death_signal() else "poll"
    if os.getppid() != parent:  # gone before the guard was set: nobody will signal us
        stop(Stop(PARENT_DEATH_SIGNAL, "parent-died"))
    if how == "poll":
        def watch_parent() -> None:
            while os.getppid() == parent:
                time.sleep(POLL_SECONDS)
            stop(Stop(PARENT_DEATH_SIGNAL, "parent-died"))

        threading.Thread(target=watch_parent, name="pipeoptim-parent", daemon=True).start()
    _installed = f"{how_signals}+{how}"
    return how


def shares_agent_store() -> bool:
    """True in a worker whose process groups rendezvous in the store of torchrun's agent, which
    outlives the worker (and so every earlier start's keys)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def fresh_join(store, rank: int, world: int, timeout: float) -> int:
    """A number, the same on every rank of this join of the job and used by no join before it over
    ``store`` (a ``torch.distributed.Store``), to rendezvous under. Rank 0 draws it from a counter
    of the store; every other rank announces itself under a key of its own making (its pid and a
    random part, which no earlier start can have left) and waits for rank 0's answer there; rank 0
    answers whatever each rank's announcement holds until every rank has taken the number (an
    earlier start's announcement, read before the new one replaced it, is answered in vain).
    Raises TimeoutError after ``timeout`` seconds without every rank."""
    if rank != 0:
        mine = f"{os.getpid()}-{uuid.uuid4().hex}"
        store.set(f"pipeoptim/join/hello/{rank}", mine)
        answer = f"pipeoptim/join/answer/{rank}/{mine}"
        store.wait([answer], timedelta(seconds=timeout))
        number = int(store.get(answer))
        store.add(f"pipeoptim/join/{number}/taken", 1)
        return number
    number = store.add("pipeoptim/join/count", 1)
    deadline = time.monotonic() + timeout
    while store.add(f"pipeoptim/join/{number}/taken", 0) < world - 1:
        for other in range(1, world):
            hello = f"pipeoptim/join/hello/{other}"
            if store.check([hello]):
                store.set(f"pipeoptim/join/answer/{other}/{store.get(hello).decode()}", str(number))
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0: not every one of the {world} ranks joined within {timeout:g} s")
        time.sleep(0.01)
    return number
