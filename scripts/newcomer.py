"""Follow the README as a newcomer does, from a fresh clone, and fail where an output differs
from what the README shows.

A benchmark run by hand: it takes minutes (it trains the quickstart in one process and twice
under torchrun, converts a checkpoint, and runs three commands of the command-line table).
``make test`` runs its cheap form, tests/test_newcomer.py, which reads the same README blocks with
this file's parser and checks, without running them, that every program and flag exists; and
tests/test_examples.py holds the quickstart's shown output to a real run with this file's
terminal and comparison.

    python scripts/newcomer.py                       # git clone, make setup, then every block
    python scripts/newcomer.py --venv .venv          # reuse a built environment: no make setup
    python scripts/newcomer.py --venv .venv --worktree   # try the working tree's uncommitted files

What it runs is read from the clone's README.md, so that the two cannot drift: every ```console
block is a shell session (a line starting with ``$ `` is a command; the lines up to the next
command are what the README shows it printing) and every ```pycon block a Python session (run by
doctest), in the README's order, from the clone's root. Each command runs in a fresh terminal (a
pseudo-terminal of 100 columns) with a newcomer's plain environment (HOME, PATH, TERM, LANG and
nothing else: no thread counts, no PYTHONPATH); a command that changes the shell (``. FILE``,
``source``, ``cd``, ``export``) carries over to the commands after it, as in one shell.

The README's lines are compared with what stayed on the terminal (a progress bar's last state,
colour codes dropped): ``...`` stands for lines left out, anywhere; a command shown without output
is not compared. Timings, rates, progress bars and dated folder names are compared by pattern
(:data:`VOLATILE`); every other character must match. The first difference ends the run, printing
what the README shows, what the terminal showed and the closest line, with exit status 1.

``--venv DIR`` skips ``make setup``: the clone gets a new, empty virtual environment whose
packages are DIR's (its site-packages read through a .pth file, its commands copied) and whose
``pipeoptim`` is the clone's own ``src`` (DIR itself is never written).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
COLUMNS, ROWS = 100, 40
SKIPPED = "..."  #: a shown line standing for lines left out

#: what may differ between the README and a run: (pattern, what both sides become)
VOLATILE: List[Tuple[str, str]] = [
    (r"\|[█▏▎▍▌▋▊▉# ]*\|", "|<bar>|"),                                   # a progress bar, any width
    (r"\[\d+:\d\d(?::\d\d)?<[\d:?]+, *[\d.?]+ ?(?:s/it|it/s)\]", "[<time>]"),  # tqdm's times and rate
    (r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ", "<log> "),                  # torch's log prefix
    (r"\b\d+(?:\.\d+)?(?= (?:[a-z]+ )?samples/s\b)", "<n>"),          # a throughput ("training samples/s")
    (r"\b\d+(?:\.\d+)? ?(?:s|ms|min)\b", "<seconds>"),
    (r"\b\d{8}-\d{6}\b", "<date>"),                                        # a run folder's time stamp
]
STATE = re.compile(r"^(\.|source|cd|export)\s")  #: commands whose effect the next commands see


@dataclass
class Command:
    """One ``$ `` line of a console block (or one pycon block, whole), with what the README shows
    it printing and the README's line number."""

    text: str
    shown: List[str]
    line: int
    kind: str = "console"  #: "console" (a shell command) or "pycon" (a Python session)

    def argv(self) -> List[str]:
        """The command's words, its comment dropped."""
        return shlex.split(self.text, comments=True)


def blocks(readme: str) -> Iterator[Tuple[str, int, List[str]]]:
    """Every fenced block of ``readme``: (its info string's first word, the line it starts on, its lines)."""
    lines = readme.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            info = lines[i][3:].strip().split(" ")[0]
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            yield info, start, body
        i += 1


def commands(readme: str) -> List[Command]:
    """What the newcomer runs, in the README's order: each command of the console blocks, each
    pycon block."""
    found: List[Command] = []
    for info, start, body in blocks(readme):
        if info == "pycon":
            found.append(Command("\n".join(body), [], start + 1, kind="pycon"))
        elif info == "console":
            for offset, line in enumerate(body):
                if line.startswith("$ "):
                    found.append(Command(line[2:], [], start + 1 + offset))
                elif not found or found[-1].line < start:
                    raise ValueError(f"README.md:{start + 1 + offset}: a console block starts with output")
                else:
                    found[-1].shown.append(line)
    return found


# ---------------------------------------------------------------------------------------------
# the comparison


def normal(line: str) -> str:
    """``line`` with what may differ between runs (:data:`VOLATILE`) made alike."""
    for pattern, same in VOLATILE:
        line = re.sub(pattern, same, line)
    return line.rstrip()


def screen(raw: str) -> List[str]:
    """The lines a terminal shows after ``raw`` was written to it: colour and cursor codes
    dropped, each line as its last carriage return left it (a progress bar's final state)."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.replace("\r\n", "\n"))
    shown = []
    for line in text.split("\n"):
        parts = [part for part in line.split("\r") if part.strip()]
        shown.append(parts[-1].rstrip() if parts else "")
    while shown and not shown[-1]:
        shown.pop()
    return shown


def difference(shown: Sequence[str], seen: Sequence[str]) -> Optional[str]:
    """None where ``seen`` (a terminal's lines) is what ``shown`` (the README's) shows, ``...``
    standing for any lines; else what differs, in words."""
    pieces: List[List[str]] = [[]]
    for line in shown:
        if line.strip() == SKIPPED:
            pieces.append([])
        else:
            pieces[-1].append(normal(line))
    have = [normal(line) for line in seen]
    free_start, free_end = shown[0].strip() == SKIPPED, shown[-1].strip() == SKIPPED
    at = 0
    filled = [piece for piece in pieces if piece]
    for order, piece in enumerate(filled):
        first = order == 0 and not free_start          # must start the output
        last = order == len(filled) - 1 and not free_end  # must end it
        starts = range(at, len(have) - len(piece) + 1)
        if first:
            starts = [at] if at <= len(have) - len(piece) else []
        if last:
            starts = [s for s in starts if s == len(have) - len(piece)]
        match = next((s for s in starts if have[s:s + len(piece)] == piece), None)
        if match is None:
            return _missing(piece, have[at:], anchored="the start" if first else "the end" if last else None)
        at = match + len(piece)
    return None


def _missing(piece: List[str], rest: List[str], anchored: Optional[str]) -> str:
    """Which of the README's lines the terminal did not show, and the closest it showed."""
    for line in piece:
        if line not in rest:
            close = difflib.get_close_matches(line, rest, n=1, cutoff=0.3)
            return (f"the README shows\n    {line}\nbut the terminal did not" +
                    (f"; its closest line:\n    {close[0]}" if close else "") +
                    ("\n" + "".join(difflib.ndiff([line + "\n"], [close[0] + "\n"])) if close else ""))
    where = f" at {anchored}" if anchored else ""
    return "the README shows these lines together" + where + ", the terminal did not:\n    " + "\n    ".join(piece)


# ---------------------------------------------------------------------------------------------
# the terminal


def plain_env(home: Optional[str] = None) -> Dict[str, str]:
    """A newcomer's environment: a home, the system's PATH, a terminal and a UTF-8 locale."""
    return {"HOME": home or os.environ.get("HOME", "/root"), "PATH": "/usr/local/bin:/usr/bin:/bin",
            "TERM": "xterm-256color", "LANG": os.environ.get("LANG") or "C.UTF-8",
            "USER": os.environ.get("USER", "newcomer")}


def run_in_terminal(argv: Sequence[str], cwd: Path, env: Dict[str, str], timeout: float) -> Tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal of :data:`COLUMNS` columns as its stdin, stdout and
    stderr; (its exit status, everything it wrote). Killed, with its children, after ``timeout``
    seconds (status 124)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
    process = subprocess.Popen(list(argv), cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave,
                               start_new_session=True)
    os.close(slave)
    chunks: List[bytes] = []
    deadline = time.monotonic() + timeout
    status = None
    try:
        while True:
            if status != 124 and time.monotonic() > deadline:
                status = 124
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # every writer closed the terminal
                    data = b""
                if not data:
                    break
                chunks.append(data)
            elif process.poll() is not None and status is None:
                status = process.returncode  # (children may still hold the terminal: read on)
    finally:
        os.close(master)
    code = process.wait()
    return (status if status == 124 else code), b"".join(chunks).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# a fresh clone


def clone(source: Path, into: Path, worktree: bool) -> None:
    """``git clone`` of ``source`` into ``into``; with ``worktree``, the working tree's tracked and
    untracked (not ignored) files copied over it, deleted ones deleted."""
    subprocess.run(["git", "clone", "--quiet", str(source), str(into)], check=True)
    if not worktree:
        return
    listed = subprocess.run(["git", "-C", str(source), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        origin, copy = source / name, into / name
        if origin.is_file():
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, copy)
        elif not origin.exists() and copy.exists():
            copy.unlink()


def reuse_venv(built: Path, repo: Path) -> None:
    """``repo/.venv``: a new virtual environment whose packages are ``built``'s (read through a
    .pth file, after the clone's own ``src``) and whose commands are ``built``'s, rewritten to
    run its python. ``built`` is only read."""
    built = built.resolve()
    base = subprocess.run([str(built / "bin" / "python"), "-c", "import sys; print(sys._base_executable)"],
                          check=True, capture_output=True, text=True).stdout.strip()
    venv = repo / ".venv"
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    found = subprocess.run([str(built / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                           check=True, capture_output=True, text=True).stdout.strip()
    ours = subprocess.run([str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(ours, "_newcomer_reuse.pth").write_text(f"{repo / 'src'}\n{found}\n")
    for script in sorted((built / "bin").iterdir()):
        if re.match(r"(python|pip)[\d.]*$|activate|Activate", script.name) or not script.is_file():
            continue  # (the new environment's own)
        text = script.read_bytes()
        if text.startswith(b"#!") and b"python" in text.split(b"\n", 1)[0]:
            target = venv / "bin" / script.name
            target.write_bytes(b"#!" + str(venv / "bin" / "python").encode() + b"\n" + text.split(b"\n", 1)[1])
            target.chmod(0o755)


# ---------------------------------------------------------------------------------------------
# following the README


@dataclass
class Newcomer:
    """A newcomer's shell in ``repo``: the commands that changed it so far, and what each run took."""

    repo: Path
    env: Dict[str, str]
    timeout: float
    venv: Optional[Path] = None
    state: List[str] = field(default_factory=list)
    times: List[Tuple[Command, str, float]] = field(default_factory=list)

    def run(self, command: Command) -> Optional[str]:
        """Run one command of the README; None where it printed what the README shows, else why not."""
        began = time.perf_counter()
        if command.kind == "console" and command.text.split("#")[0].split() == ["make", "setup"] and self.venv:
            self.times.append((command, f"skipped: --venv {self.venv}", 0.0))
            return None
        if command.kind == "console" and STATE.match(command.text):
            self.state.append(command.text)
            self.times.append((command, "carried over to the next commands", 0.0))
            return None
        if command.kind == "pycon":
            session = self.repo.parent / f"readme-line-{command.line}.txt"  # (outside the clone)
            session.write_text(command.text + "\n")
            script = f"python -m doctest -o ELLIPSIS {shlex.quote(str(session))}"
        else:
            script = command.text
        status, raw = run_in_terminal(["bash", "--noprofile", "--norc", "-c", "\n".join([*self.state, script])],
                                      self.repo, self.env, self.timeout)
        seconds = time.perf_counter() - began
        seen = [line.replace(str(self.repo) + "/", "") for line in screen(raw)]
        problem = None
        if status != 0:
            problem = f"exit status {status}" + (" (timed out)" if status == 124 else "")
        elif command.kind == "pycon" and seen:
            problem = "the session printed what the README does not show (doctest's report or a warning)"
        elif command.shown:
            problem = difference(command.shown, seen)
        self.times.append((command, "ok" if problem is None else "DIFFERS", seconds))
        if problem is None:
            return None
        return problem + "\n--- the terminal showed ---\n" + "\n".join(seen[-60:])


def summary(times: Sequence[Tuple[Command, str, float]], total: float) -> str:
    rows = [f"{seconds:7.1f} s  {verdict:<8}  README.md:{command.line}  "
            f"{command.text.splitlines()[0] if command.kind == 'console' else '(pycon) ' + command.text.splitlines()[0]}"
            for command, verdict, seconds in times]
    return "\n".join(rows + [f"{total:7.1f} s  in all"])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=ROOT, help="the repository to clone (default: this one)")
    parser.add_argument("--venv", type=Path, default=None,
                        help="a built environment to reuse instead of running make setup (only read)")
    parser.add_argument("--worktree", action="store_true",
                        help="copy the source's working tree over the clone (its uncommitted changes)")
    parser.add_argument("--into", type=Path, default=None, help="the folder to clone into (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the clone (it is kept anyway when a step fails)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per command")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    where = args.into or Path(tempfile.mkdtemp(prefix="pipeoptim-newcomer-"))
    repo = where / "pipeoptim"
    clone(args.source.resolve(), repo, args.worktree)
    if args.venv:
        reuse_venv(args.venv, repo)
    print(f"newcomer: a fresh clone in {repo}" + (f", reusing {args.venv}" if args.venv else ""), flush=True)
    newcomer = Newcomer(repo, plain_env(), args.timeout, venv=args.venv)
    for command in commands((repo / "README.md").read_text()):
        problem = newcomer.run(command)
        verdict, seconds = newcomer.times[-1][1:]
        print(f"{seconds:7.1f} s  {verdict:<8}  README.md:{command.line}", flush=True)
        if problem is not None:
            print(f"\nREADME.md:{command.line}: {command.text.splitlines()[0]}\n{problem}\n", file=sys.stderr)
            print(summary(newcomer.times, time.perf_counter() - began))
            print(f"newcomer: the clone is kept in {repo}", file=sys.stderr)
            return 1
    print(summary(newcomer.times, time.perf_counter() - began))
    if not args.keep and args.into is None:
        shutil.rmtree(where, ignore_errors=True)
    return 0


# ---------------------------------------------------------------------------------------------
# the cheap form's checks (tests/test_newcomer.py): programs and flags, without running them


def script_flags(path: Path) -> Set[str]:
    """The option strings a script's argparse takes (read from its source: ``add_argument`` calls),
    ``-h``/``--help`` included."""
    flags = {"-h", "--help"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags.update(a.value for a in node.args if isinstance(a, ast.Constant)
                         and isinstance(a.value, str) and a.value.startswith("-"))
    return flags


def unknown_flags(words: Sequence[str], known: Set[str]) -> List[str]:
    return [w.split("=")[0] for w in words if w.startswith("-") and w.split("=")[0] not in known]


if __name__ == "__main__":
    sys.exit(main())
