"""Errors a user can fix or catch, importable without torch. The command line catches them to
print one line instead of a traceback, before it imports torch.

A refusal names an option in the words of the interface in use (:func:`option`): Python's
keyword (``micro_batches=4``), or the flag (``--micro-batches 4``) while the command line runs
(:func:`command_line_words`, around each subcommand and in each stage process it starts). An
error of the user's own code inside a pass of the pipeline is raised again saying where
(:func:`placed`).
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import signal
import threading
from typing import Any, ContextManager, Dict, Iterable, Iterator, List, Optional

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


# -- the words of the interface in use ----------------------------------------------------------
#: the command line's flag of each option it takes, while it runs (None: a Python caller, whose
#: keywords the refusals name)
_FLAGS: contextvars.ContextVar[Optional[Dict[str, str]]] = contextvars.ContextVar("pipeoptim_flags", default=None)
_NO_VALUE = object()


class Shown(str):
    """A value a refusal shows as it is in either interface (a placeholder: ``N``, ``MAX_NORM``),
    not as Python's literal."""

    def __repr__(self) -> str:
        return str(self)


@contextlib.contextmanager
def command_line_words(options: Iterable[Any], own: Optional[Dict[str, str]] = None) -> Iterator[None]:
    """Within the block, refusals name options as the command line's flags. ``options``: the
    option tables' entries (``pipeoptim.options.OPTIONS`` and the lab's), each with its ``flag``
    (``Flag.flag_name``) or None where the command line does not take it; ``own``: a subcommand's
    flags of options in neither table, by name (``{"memory_limit": "--memory-limit"}``)."""
    flags = {o.name: o.flag.flag_name(o.name) for o in options if o.flag is not None}
    for name, said in (own or {}).items():
        flags.setdefault(name, said)
    token = _FLAGS.set(flags)
    try:
        yield
    finally:
        _FLAGS.reset(token)


def on_command_line() -> bool:
    """Whether the command line runs (:func:`command_line_words`)."""
    return _FLAGS.get() is not None


def flag(name: str) -> Optional[str]:
    """The flag of option ``name`` while the command line runs; None in Python, or where the
    command line does not take it."""
    flags = _FLAGS.get()
    return flags.get(name) if flags is not None else None


def option(name: str, value: Any = _NO_VALUE) -> str:
    """Option ``name`` (its keyword) as a refusal names it, with ``value`` where given: in Python
    ``micro_batches``, ``micro_batches=4``, ``clip_scope='global'``; on the command line its flag,
    ``--micro-batches``, ``--micro-batches 4`` (a list comma-separated, True the flag alone). An
    option the command line does not take keeps its keyword there, marked (Python only)."""
    flags = _FLAGS.get()
    said = flags.get(name) if flags is not None else None
    if said is None:
        keyword = name if value is _NO_VALUE else f"{name}={value!r}"
        return keyword if flags is None else f"{keyword} (Python only)"
    if value is _NO_VALUE or value is True:
        return said
    if isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    return f"{said} {value}"


# -- the user's errors inside a pipeline's passes -------------------------------------------------
_ENGINE = os.path.dirname(os.path.abspath(__file__))
_LAB = os.path.join(_ENGINE, "lab")


def _raised_by_engine(error: BaseException) -> bool:
    """Whether ``error`` was raised by the engine's own code (a refusal, a transport's error):
    the innermost frame of its traceback is in this package, outside the lab (whose models are
    a user's code as any other)."""
    tb, last = error.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return False
    name = os.path.abspath(last.tb_frame.f_code.co_filename)
    return name.startswith(_ENGINE + os.sep) and not name.startswith(_LAB + os.sep)


def layers_of(module: Any, most: int = 6) -> str:
    """A stage's layers as an error names them: a piece of an ``nn.Sequential`` by its layers'
    numbers in the model and their types (``layers 3-5: Linear, ReLU, Linear``); a traced piece by
    the submodules it runs, a list's items one by one (``blocks.1, blocks.2, head``); at most
    ``most`` names, the last kept."""
    children = list(module.named_children())
    if children and all(name.isdigit() for name, _ in children):
        first, last = children[0][0], children[-1][0]
        span = f"layer {first}" if first == last else f"layers {first}-{last}"
        return f"{span}: {_listed([type(child).__name__ for _, child in children], most)}"
    return _listed(_unit_names(module), most) or type(module).__name__


def _unit_names(module: Any, prefix: str = "") -> List[str]:
    """The qualified names of the submodules ``module`` runs: each child, each item of a child that
    is a list (its children numbered), the units inside a child that holds a list deeper down."""
    def is_list(m: Any) -> bool:
        names = [n for n, _ in m.named_children()]
        return bool(names) and all(n.isdigit() for n in names)

    names: List[str] = []
    for name, child in module.named_children():
        if is_list(child):
            names += [f"{prefix}{name}.{item}" for item, _ in child.named_children()]
        elif any(is_list(m) for m in child.modules()):
            names += _unit_names(child, f"{prefix}{name}.")
        else:
            names.append(prefix + name)
    return names


def _listed(names: List[str], most: int) -> str:
    if len(names) <= most:
        return ", ".join(names)
    return ", ".join(names[:most - 1]) + f", ..., {names[-1]} ({len(names)})"


def placed(error: Exception, where: str) -> Optional[Exception]:
    """``error``, raised by the user's code (the model, the loss, the optimizer) in a pass of the
    pipeline, as an error of the same type (a RuntimeError where that type cannot be made from a
    message) whose message begins with ``where`` (the rank, stage, pass and micro-batch), to be
    raised ``from error``; None where the error needs no more (the pipeline's own, or placed
    already by an inner pass)."""
    if getattr(error, "pipeoptim_where", None) is not None or _raised_by_engine(error):
        return None
    message = f"{where}: {error}"
    try:
        again = type(error)(message)
        if str(again) != message:
            raise TypeError
    except Exception:  # noqa: BLE001 - a type whose constructor wants other arguments
        again = RuntimeError(message)
    again.pipeoptim_where = where  # type: ignore[attr-defined]
    return again
