"""`z launch`: start a training script on every rank through torchrun.

zstack has no launcher or rendezvous of its own (ARCHITECTURE.md, fixed
decisions): this module only turns `z launch` options into the argv of
`torch.distributed.run` and runs it. One node uses torchrun's static
rendezvous on `--master-addr/--master-port` (`--master-port 0`: a free port,
via `--standalone`); several nodes with `--rdzv-endpoint host:port` use the
c10d rendezvous, which also allows elastic `--nnodes MIN:MAX`.

Every rank runs the script through `zstack.rank_entry`, which ties the rank's life to the
launcher's: torchrun starts ranks in sessions of their own, so without it a `kill -9` of
the launcher would leave them running.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from zstack.rank_entry import LAUNCHER_PID

RANK_ENTRY = "zstack.rank_entry"
"""The module torchrun runs on every rank (`python -m`); it then runs the script."""


class LaunchError(ValueError):
    """Options that cannot make a valid torchrun command; the message says what to change."""


def _parse_nnodes(nnodes: str) -> tuple[int, int]:
    parts = nnodes.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        low, high = 0, 0
    if low < 1 or high < low:
        raise LaunchError(f"`--nnodes {nnodes}` is not N or MIN:MAX with 1 <= MIN <= MAX")
    return low, high


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _summarize(script: str, failures: dict[int, Any]) -> str:
    """One line naming the failed ranks and, apart, those torchrun stopped (SIGTERM) after."""
    failed = {rank: f.exitcode for rank, f in failures.items() if f.exitcode != -signal.SIGTERM}
    stopped = sorted(set(failures) - set(failed))
    if not failed:  # every rank got SIGTERM from outside: they are the failure
        failed, stopped = {rank: failures[rank].exitcode for rank in stopped}, []
    ranks = sorted(failed)
    # Without `@record` in the script torchrun cannot tell which rank failed first (a rank's
    # peers fail too once it is gone), so every failed rank is named.
    line = (
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} of `{script}` "
        f"failed ({', '.join(_describe_exit(failed[rank]) for rank in ranks)})"
    )
    if stopped:
        line += f"; torchrun stopped {'rank' if len(stopped) == 1 else 'ranks'} "
        line += ", ".join(map(str, stopped))
    return line + "; tracebacks are above"


def build_argv(
    script: str,
    script_args: list[str],
    *,
    nproc: int,
    nnodes: str,
    node_rank: int,
    master_addr: str,
    master_port: int,
    rdzv_endpoint: str,
) -> list[str]:
    """The `torch.distributed.run` argv (without the program name) for these options.

    torchrun runs `python -m zstack.rank_entry SCRIPT SCRIPT_ARGS...` on every rank.
    Raises `LaunchError` for combinations torchrun would reject later or misread:
    elastic node counts without a rendezvous endpoint, a node rank outside the
    node count.
    """
    if nproc < 1:
        raise LaunchError(f"`--nproc {nproc}` must be at least 1")
    low, high = _parse_nnodes(nnodes)
    argv = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
    if rdzv_endpoint:
        # c10d rendezvous assigns node ranks itself; master addr/port come from the endpoint.
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    elif low != high:
        raise LaunchError(
            f"elastic `--nnodes {nnodes}` needs a c10d rendezvous: add `--rdzv-endpoint HOST:PORT`"
        )
    elif node_rank >= high:
        raise LaunchError(f"`--node-rank {node_rank}` must be below `--nnodes {nnodes}`")
    elif master_port == 0:
        if high != 1:
            raise LaunchError(
                "`--master-port 0` (pick a free port) works on one node only; "
                "give every node the same `--master-port`"
            )
        argv += ["--standalone"]
    else:
        argv += [
            f"--node-rank={node_rank}",
            f"--master-addr={master_addr}",
            f"--master-port={master_port}",
        ]
    return [*argv, "--module", RANK_ENTRY, script, *script_args]


def main(
    script: str,
    script_args: list[str],
    nproc: int,
    nnodes: str,
    node_rank: int,
    master_addr: str,
    master_port: int,
    rdzv_endpoint: str,
) -> int:
    """Run `script` with `script_args` on `nproc` ranks per node through torchrun.

    Returns 0 when every rank exits 0, 1 when any rank fails (as the `torchrun`
    command does), 128 + N when the launcher is stopped by signal N, and 2
    when the script does not exist or the options are invalid (nothing is
    started then).
    """
    path = Path(script)
    if not path.is_file():
        print(f"error: script `{path}` not found (looked in `{path.resolve()}`)", file=sys.stderr)
        return 2
    try:
        argv = build_argv(
            script,
            script_args,
            nproc=nproc,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            rdzv_endpoint=rdzv_endpoint,
        )
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    # torchrun runs in this process rather than as `python -m torch.distributed.run`: that
    # saves a second interpreter and torch import (seconds), its agent then gets SIGINT/SIGTERM
    # directly and stops the workers itself (no forwarding to write), and a failure comes back
    # as `ChildFailedError` naming the rank instead of text on stderr.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    # torchrun's own parser would take a script option that abbreviates one of its options
    # (`--nproc`, `--log`) as its own; only exact torchrun options belong to torchrun here.
    parser = get_args_parser()
    parser.allow_abbrev = False
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the ranks' parent (torchrun's agent is here)
    try:
        run(parser.parse_args(argv))
    except ChildFailedError as exc:
        print(f"error: {_summarize(script, exc.failures)}", file=sys.stderr)
        return 1
    except RendezvousError as exc:
        where = rdzv_endpoint or f"{master_addr}:{master_port}"
        print(f"error: rendezvous at `{where}` failed: {exc}", file=sys.stderr)
        return 1
    except SignalException as exc:
        print(f"error: launcher stopped by signal {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    except SystemExit as exc:  # torchrun's argparse rejected an option
        return exc.code if isinstance(exc.code, int) else 2
    return 0
