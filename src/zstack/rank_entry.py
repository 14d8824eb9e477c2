"""What every rank of `z launch` and `z train` runs first: die with the launcher, then the script.

torchrun's agent starts each rank in a session of its own (`Popen(start_new_session=True)`),
so nothing that stops the launcher alone reaches the ranks: after a `kill -9` of the
launcher (the OOM killer, a closed terminal, a scheduler's preemption) they would go on
training and writing checkpoints into the run directory. `z launch` therefore has torchrun
run `python -u -m zstack.rank_entry SCRIPT ARGS...` on every rank. This module asks the
kernel for SIGKILL when its parent dies (`PR_SET_PDEATHSIG`, Linux), exits at once if
the launcher is already gone (it may die before the request is made), and then runs
SCRIPT as `__main__` with `sys.argv == [SCRIPT, *ARGS]` and the script's directory first
on `sys.path`, as `python SCRIPT ARGS...` would.

The death signal is SIGKILL, which a rank cannot catch: a rank killed mid-save leaves the
previous checkpoint intact (checkpoints are written to a temporary directory and renamed).
Linux sends it when the *thread* that forked the rank ends; torchrun's agent starts and
restarts workers from its main thread, which lives as long as the launcher. Elsewhere a
daemon thread polls the parent pid once a second instead.
"""

from __future__ import annotations

import os
import runpy
import sys

LAUNCHER_PID = "ZSTACK_LAUNCHER_PID"
"""The environment variable in which the launcher gives the ranks its pid."""


def die_with_launcher(launcher: int | None = None) -> None:
    """Make this process end when `launcher` (default: `$ZSTACK_LAUNCHER_PID`, else the
    current parent) ends; exits with status 1 at once if it has already ended
    (`zcore.lifetime.die_with_parent`)."""
    from zcore.lifetime import die_with_parent

    if launcher is None:
        launcher = int(os.environ.get(LAUNCHER_PID) or os.getppid())
    die_with_parent(launcher, f"rank {os.environ.get('RANK', '?')}")


def main() -> None:
    """`python -m zstack.rank_entry SCRIPT ARGS...`."""
    if len(sys.argv) < 2:
        usage = "usage: `python -m zstack.rank_entry SCRIPT [ARGS]...`"
        print(f"error: no script given; {usage}", file=sys.stderr)
        sys.exit(2)
    die_with_launcher()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # was the cwd (`python -m`)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
