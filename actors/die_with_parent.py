"""Run a command whose whole process group dies with the process that started it.

    python -m actors.die_with_parent <parent pid> -- <command> [args...]

This process leads a process group of its own (a new session, unless started as a group's
leader) and runs the command as its child in that group, waiting for it. Beside it in the group
runs a guard, its own child, whose one job is to kill the whole group (an SGLang server, its
scheduler and detokenizer, their resource tracker last: process_group.py says why) when this
process dies. The kernel tells both (prctl PR_SET_PDEATHSIG): this process gets SIGTERM when
its starter dies, even by SIGKILL, and dies of it; the guard gets SIGTERM when this process
dies, however it dies. When the command exits on its own, this process kills what the command
left in the group and exits with the command's status.

Why a guard: Ray SIGKILLs an actor's children as the actor dies (its
kill_child_processes_on_worker_exit, measured: a child ignoring SIGTERM was gone 5 s after its
driver's SIGKILL, never having seen one), so this process cannot be the one that cleans up; and
a PDEATHSIG on the server alone is not enough: SGLang's children set their own only once they
have imported (seconds after they start), and a server killed meanwhile left its detokenizer
and resource tracker as orphans for good (the fault campaign found three such pairs after one
capture job). Needs only Python and Linux, and fails loudly elsewhere.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from types import FrameType

from actors.process_group import group_pids, kill_group

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m actors.die_with_parent <parent pid> -- <command> [args...]")
    parent, command = int(argv[0]), argv[2:]
    if os.getpgrp() != os.getpid():  # a group of its own, whatever the starter asked for
        os.setsid()
    _set_parent_death_signal(signal.SIGTERM)  # its default action: this process ends
    if os.getppid() != parent:  # it died before the prctl: nobody would signal us
        sys.exit(f"die_with_parent: parent {parent} is gone; not starting {command[0]}")
    supervisor = os.getpid()
    if os.fork() == 0:
        _guard(supervisor)
    child = os.fork()
    if child == 0:
        _exec_child(supervisor, command)
    _, status = os.waitpid(child, 0)
    kill_group(os.getpgrp(), spare=supervisor)  # what the command left, the guard with it
    sys.exit(_exit_code(status))


def _guard(supervisor: int) -> None:
    """In the forked guard: once the supervisor is gone, the whole group goes, this process
    last (kill_group's final killpg)."""
    try:

        def take_group_down(signum: int = 0, frame: FrameType | None = None) -> None:
            group = os.getpgrp()
            kill_group(group, [pid for pid in group_pids(group) if pid != os.getpid()])

        signal.signal(signal.SIGTERM, take_group_down)
        _set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != supervisor:  # it died before the prctl
            take_group_down()
        while True:
            signal.pause()
    finally:
        os._exit(1)  # never return into the supervisor's code


def _exec_child(supervisor: int, command: list[str]) -> None:
    """In the forked child: die with the supervisor, then become the command."""
    try:
        _set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != supervisor:  # it was killed before the prctl
            os._exit(1)
        os.execvp(command[0], command)
    except BaseException as exc:  # never return into the supervisor's code
        print(f"die_with_parent: cannot run {command[0]}: {exc}", file=sys.stderr, flush=True)
        os._exit(127)


def _exit_code(status: int) -> int:
    """The shell's convention: the code, or 128 + the signal that killed the command."""
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _set_parent_death_signal(sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")


if __name__ == "__main__":
    main(sys.argv[1:])
