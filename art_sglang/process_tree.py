"""Child processes of the backend: `ManagedProcess`, the base of the server and trainer handles (start a
logged child in its own session, its log tail, "died with exit code" messages, stop its whole tree, kill
it at interpreter exit or when the handle is collected), and the process-tree helpers under it (kill a
tree reliably, ask Linux to kill a child when its parent dies, wait for every one of several process
calls)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path
from subprocess import DEVNULL, PIPE, STDOUT, Popen
from typing import Any

import psutil

_PR_SET_PDEATHSIG = 1
LOG_TAIL_LINES = 40
# At interpreter exit, when a forgotten handle is collected, or when clearing a crashed tree, nobody waits
# on the child any more, so a short grace period is enough before SIGKILL.
EXIT_GRACE_SECONDS = 5.0
_SECRET_FLAGS = ("--api-key", "--admin-api-key")


class ManagedProcess:
    """One child process (and its tree) logging to `log_path`, named `label` in messages.

    Subclasses build the command and decide how to talk to the child; this base starts it in its own
    session (`_launch`), reads its log tail, words its death, and stops its whole tree (`_terminate`). The
    tree is also killed at interpreter exit, when the handle is garbage collected, and (on Linux) by the
    kernel when the thread that started it dies — so start it from a long-lived thread such as the main
    thread or the event loop's.
    """

    def __init__(self, label: str, log_path: Path) -> None:
        self.label = label
        self.log_path = Path(log_path)
        self._popen: Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        self._log_start = 0  # byte offset in the log where the current launch begins

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    def _launch(
        self, command: list[str], env: dict[str, str], *, pipes: bool, note: str = ""
    ) -> Popen[bytes]:
        """Start `command` (see `spawn_logged`); runs on the caller's thread on purpose (parent-death signal)."""
        header = f"starting {self.label}: {display_command(command)}{note}"
        popen, self._log_start = spawn_logged(command, self.log_path, header=header, env=env, pipes=pipes)
        self._popen = popen
        self._finalizer = weakref.finalize(self, kill_process_tree, popen.pid, EXIT_GRACE_SECONDS)
        return popen

    def exit_code(self) -> int | None:
        """The exit code once it exited (negative: killed by that signal), None while it runs or before
        it started. Leaves the child unreaped (see `peek_exit_code`)."""
        return peek_exit_code(self._popen) if self._popen is not None else None

    def is_alive(self) -> bool:
        return self._popen is not None and peek_exit_code(self._popen) is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines this launch wrote to the log."""
        return read_log_tail(self.log_path, self._log_start, lines)

    def describe_death(self, what: str) -> str:
        """ "The <label> (pid N) <what> (exit code C)." with the log's path and tail."""
        pid = f" (pid {self._popen.pid})" if self._popen is not None else ""
        return (
            f"The {self.label}{pid} {what} (exit code {self.exit_code()}).\n"
            f"log: {self.log_path}\n--- last lines of the log ---\n{self.log_tail()}"
        )

    async def _terminate(self, timeout: float) -> Popen[bytes] | None:
        """SIGTERM the tree, SIGKILL what is left after `timeout` s, reap it. Returns the Popen that was
        running (None if none) for the subclass's own cleanup. Idempotent."""
        popen, self._popen = self._popen, None
        if popen is None:
            return None
        if self._finalizer is not None:
            self._finalizer.detach()
        await asyncio.to_thread(kill_process_tree, popen.pid, timeout)
        popen.poll()  # reaped by now; keeps the Popen's own bookkeeping consistent
        return popen


def display_command(command: list[str]) -> str:
    """The command as a shell line, with secrets hidden (it goes to logs and error messages)."""
    shown = list(command)
    for i, arg in enumerate(shown[:-1]):
        if arg in _SECRET_FLAGS:
            shown[i + 1] = "REDACTED"
    return shlex.join(shown)


def read_log_tail(path: Path, start: int = 0, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of the log written after byte offset `start` ('' if there is no log)."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            # 64 KiB comfortably holds 40 lines, even of tracebacks.
            f.seek(max(start, size - 65536))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def spawn_logged(
    command: list[str], log_path: Path, *, header: str, env: dict[str, str], pipes: bool
) -> tuple[Popen[bytes], int]:
    """Start `command` in its own session (its own process group), SIGKILLed when we die (Linux), with a
    stamped `header` line and the child's output appended to `log_path`. With `pipes`, the child's stdin
    and stdout are pipes to us and only its stderr goes to the log. Returns the process and the log offset
    where this launch begins. Call it on a long-lived thread (see `parent_death_preexec`)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        start = log.tell()
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
        log.write(f"=== {stamp} {header}\n".encode())
        log.flush()
        # The child keeps its own copy of the file descriptor, so ours can close right away.
        popen = Popen(
            command,
            stdin=PIPE if pipes else DEVNULL,
            stdout=PIPE if pipes else log,
            stderr=log if pipes else STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=parent_death_preexec(),
        )
    return popen, start


def collect_tree(pid: int) -> list[psutil.Process]:
    """The process `pid`, its descendants, and the members of the process group it leads or led.

    The group finds descendants even after `pid` died and they were reparented: a process-group id is
    the leader's pid, and Linux does not reuse a pid while a group of that id has members.
    """
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    return procs + [p for p in psutil.process_iter() if p not in procs and _pgid(p.pid) == pid]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def kill_process_tree(pid: int, timeout: float = 20.0) -> None:
    """SIGTERM the tree rooted at `pid` (and its process group), wait up to `timeout` seconds, then
    SIGKILL whatever is left and reap it. Safe if the process is already gone.

    The tree is collected before any signal: once the root dies its children are reparented and can no
    longer be found from it.
    """
    procs = collect_tree(pid)
    _signal_all(pid, procs, signal.SIGTERM)
    alive = _wait_gone(procs, timeout)
    # Descendants spawned during the grace period are picked up too.
    alive += [p for p in collect_tree(pid) if p not in alive]
    if alive:
        _signal_all(pid, alive, signal.SIGKILL)
        _wait_gone(alive, 10.0)


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every process has exited; returns those still running after `timeout` seconds.

    Our own children are reaped; a zombie of someone else's counts as gone (init may reap it seconds later).
    """
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        proc.wait(timeout=0)  # reaps it if it is our child
        return False
    except psutil.TimeoutExpired:
        try:
            # Our own child counts as gone only once reaped: its main thread shows as a zombie while its
            # other threads still exit, and reaping must wait for them.
            return proc.ppid() == os.getpid() or proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


def _signal_all(pid: int, procs: list[psutil.Process], sig: signal.Signals) -> None:
    # The process group reaches descendants that already left the tree (e.g. a daemonised worker).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    # Members of the group got it already: a second SIGTERM can re-enter a server's shutdown handler.
    for proc in procs:
        if _pgid(proc.pid) != pid:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                proc.send_signal(sig)


def peek_exit_code(popen: subprocess.Popen[Any]) -> int | None:
    """The child's exit code (negative signal number if a signal killed it), or None while it runs.

    Unlike `Popen.poll()` it leaves the exited child unreaped, so its pid (and process-group id) cannot be
    reused by an unrelated process before `kill_process_tree` has cleared what is left of its tree.
    """
    if popen.returncode is not None:
        return popen.returncode
    try:
        info = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere
        return popen.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def parent_death_preexec() -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen` that makes Linux SIGKILL the child when its parent dies, so a
    SIGKILLed parent leaves no orphan; None off Linux.

    The signal fires when the *thread* that forked the child exits, so call Popen from a long-lived thread
    (the main thread or the event loop's), never from a short-lived worker thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    # Resolved before the fork: loading a library in the forked child can deadlock on a lock held by
    # another thread of the parent.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()
    return lambda: _die_with(prctl, parent)


def die_with_parent() -> None:
    """From inside a process whose parent started it without `parent_death_preexec` (torch's launcher
    starts its workers itself): Linux SIGKILLs this process when its parent dies. No-op off Linux."""
    if sys.platform.startswith("linux"):
        _die_with(ctypes.CDLL(None, use_errno=True).prctl, os.getppid())


def _die_with(prctl: Callable[..., int], parent: int) -> None:
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


async def gather_all(*calls: Awaitable[Any]) -> list[Any]:
    """Run `calls` concurrently and wait for every one of them, even when one fails (nothing is left
    running behind an error); then raise the first error."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
