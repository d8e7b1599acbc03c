"""Run a command that is sent SIGTERM when the process that started it dies.

    python -m actors.die_with_parent <parent pid> -- <command> [args...]

prctl(PR_SET_PDEATHSIG), then exec: the setting survives exec, so the command (an SGLang server,
in its own session and out of reach of its starter's process group) gets SIGTERM from the
kernel when its starter dies, even by SIGKILL, and never holds a node's GPUs as an orphan.
util-linux's `setpriv --pdeathsig` does the same where it is installed; this needs only Python
and Linux, and fails loudly elsewhere.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m actors.die_with_parent <parent pid> -- <command> [args...]")
    parent, command = int(argv[0]), argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != parent:  # it died before the prctl: nobody would signal us
        sys.exit(f"die_with_parent: parent {parent} is gone; not starting {command[0]}")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
