"""What the multi-rank benchmarks share: starting a benchmark script on every rank, a free
loopback port for the rendezvous and the resident memory of a rank. Load it with
``zcore.bench.load("_ranks", Path(__file__).parent)``.

A multi-rank benchmark runs its own file once per rank, as a fresh interpreter (each rank
measures a process of its own: memory from zero, no state shared with the parent), with
:func:`launch`; the file's ``__main__`` hands :func:`rank_spec`'s spec to its rank function,
which ends with :func:`write_result`.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zcore.process import free_port

__all__ = ["cpu_name", "free_port", "launch", "memory_mb", "rank_spec", "write_result"]

SPEC_FLAG = "--rank-spec"
"""``python SCRIPT --rank-spec FILE``: how :func:`launch` starts a rank."""

_TAIL_LINES = 20


def launch(
    script: str | os.PathLike[str],
    world: int,
    spec: dict[str, Any],
    work: str | os.PathLike[str],
    *,
    timeout_s: float,
    what: str,
    env: dict[str, str] | None = None,
    port: int | None = None,
    per_rank: Callable[[int], tuple[list[str], dict[str, str]]] | None = None,
) -> list[Any]:
    """What each of ``world`` ranks of ``python script --rank-spec FILE`` passed to
    :func:`write_result`, in rank order.

    Rank ``r``'s spec is ``spec`` plus ``rank``, ``world``, ``port`` (the rendezvous port on
    127.0.0.1: a free one unless given) and ``out`` (where its result goes). Its environment
    is ``env`` (default: this process's) plus torch.distributed's ``env://`` variables
    (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``) and ``ZSTACK_LAUNCHER_PID`` (this process, for
    ``zcore.lifetime.die_with_parent``); ``per_rank(r)`` may give a command prefix (a network
    namespace's ``ip netns exec``) and variables that replace those. Its output goes to a log
    file under ``work``; what a peer's ranks leave in ``/dev/shm`` for ``port`` is removed once
    they are gone. A rank that exits with an error, or no result, fails the launch, as
    does ``timeout_s`` passing (every rank is then killed): ``RuntimeError`` naming ``what``,
    the exit codes and the last lines of each failed rank's log."""
    port = free_port() if port is None else port
    run_dir = Path(tempfile.mkdtemp(prefix=f"ranks-{port}-", dir=work))
    procs, logs = [], []
    for rank in range(world):
        mine = {**spec, "rank": rank, "world": world, "port": port}
        mine["out"] = str(run_dir / f"rank{rank}.json")
        spec_file = run_dir / f"rank{rank}.spec.json"
        spec_file.write_text(json.dumps(mine))
        rank_env = dict(os.environ if env is None else env)
        rank_env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            ZSTACK_LAUNCHER_PID=str(os.getpid()),
        )
        prefix: list[str] = []
        if per_rank is not None:
            prefix, extra = per_rank(rank)
            rank_env.update(extra)
        log = open(run_dir / f"rank{rank}.log", "w")  # closed below
        logs.append(log)
        cmd = [*prefix, sys.executable, str(script), SPEC_FLAG, str(spec_file)]
        procs.append(subprocess.Popen(cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    codes: list[int] | None = None
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
        _remove_peer_shm(port)
    outs = [run_dir / f"rank{r}.json" for r in range(world)]
    failed = [r for r in range(world) if codes is None or codes[r] != 0 or not outs[r].is_file()]
    if failed:
        why = f"timed out after {timeout_s:g} s" if codes is None else f"exit codes {codes}"
        tails = "\n".join(
            f"rank {r} (last lines of {run_dir / f'rank{r}.log'}):\n{_tail(run_dir, r)}"
            for r in failed
        )
        raise RuntimeError(f"{what}: the {world} ranks failed ({why})\n{tails}")
    return [json.loads(o.read_text()) for o in outs]


def _remove_peer_shm(port: int) -> None:
    """Remove what DeepSpeed's CPU shared-memory all-reduce leaves in ``/dev/shm`` for this
    launch's rendezvous port (``deepspeed_allreduce_buffer_<rank>_<addr>_<port>_<n>``, about
    64 MiB a rank, never unlinked by DeepSpeed): the ranks are gone, nothing maps them."""
    for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
        leftover.unlink(missing_ok=True)


def _tail(run_dir: Path, rank: int) -> str:
    lines = (run_dir / f"rank{rank}.log").read_text(errors="replace").splitlines()
    return "\n".join(lines[-_TAIL_LINES:])


def rank_spec(argv: list[str]) -> dict[str, Any] | None:
    """The spec :func:`launch` gave this rank, when ``argv`` is a rank's command line."""
    if len(argv) == 3 and argv[1] == SPEC_FLAG:
        return json.loads(Path(argv[2]).read_text())
    return None


def write_result(spec: dict[str, Any], result: Any) -> None:
    """This rank's result (JSON-ready), for :func:`launch` to return."""
    Path(spec["out"]).write_text(json.dumps(result))


def cpu_name() -> str:
    """This host's CPU model as ``/proc/cpuinfo`` names it (else what ``platform`` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_mb() -> dict[str, float]:
    """Current and peak resident memory of this process, MB (VmRSS / VmHWM)."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(rest.split()[0]) / 1024
    except OSError:  # not Linux: ru_maxrss is the peak (kB on Linux, bytes on macOS)
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["VmHWM"] = peak / (2**20 if sys.platform == "darwin" else 1024)
    return out
