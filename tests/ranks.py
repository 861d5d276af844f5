"""Multi-rank jobs without torchrun's import tax: every rank is a fork of one server process
that imported torch, the package and each model family's library once per test session.

`run_ranks("sdp.train:main", argv, nproc=2, cwd=..., env=...)` runs `main(argv)` on each of
`nproc` ranks and returns what `python -m sdp.train --nproc-per-node=nproc` would: a
CompletedProcess whose returncode is the entrypoint's launcher's (`job_exit_code`), with the
ranks' stdout and stderr in rank order. Each rank gets what torchrun gives a worker: RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, and the address of a store this process serves
(MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE), in the caller's `env` and `cwd`,
with one thread. As torchrun does, a rank that fails gets the others SIGTERM, then SIGKILL
after `TERM_GRACE_S`.

The server is multiprocessing's forkserver: a clean process (no pytest state, no process
group, no threads) started on first use; forking it costs milliseconds where a fresh
interpreter costs 3 to 10 s of imports on 2 cores. What only a real launch can show (the
CLI under torchrun, restarts, signals, a hung rank, resize, a sweep's jobs) still uses torchrun.
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.connection
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from torch.distributed import TCPStore

# Imported once, in the server; every rank starts with them loaded.
PRELOAD = [
    "torch",
    "torch.distributed",
    "sdp.train",
    "sdp.models.llama",
    "sdp.models.resnet",
    "sdp.models.swin",
    "conftest",
    "ranks",
]
TERM_GRACE_S = 30.0
_CONTEXT: multiprocessing.context.BaseContext | None = None
# What this test session started: jobs run here and the ranks they forked (tests/conftest.py
# prints them, beside torchrun's launches).
STARTED = {"jobs": 0, "ranks": 0}


def _context() -> multiprocessing.context.BaseContext:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def agent_store(nproc: int) -> TCPStore:
    """The job's store, served by this process on a port the kernel picks, as torchrun's agent
    serves one: rank 0 does not bind a port chosen earlier, which another job of the session
    (a pytest-xdist worker beside this one) could take between the choice and the bind (seen
    once in CI: a rank's store client reset by a peer that was not its job's store)."""
    return TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _exit_code(err: SystemExit) -> int:
    if err.code is None or isinstance(err.code, int):
        return err.code or 0
    print(err.code, file=sys.stderr)  # as the interpreter does for SystemExit("message")
    return 1


def _rank_main(target: str, args: list, world: dict[str, str], cwd: str, env: dict[str, str], logs: str) -> None:
    """One rank, in a fork of the server: torchrun's worker environment, then `target(args)`."""
    os.environ.clear()
    os.environ.update({**env, **world})
    os.chdir(cwd)
    rank = world["RANK"]
    for fd, name in ((1, f"{rank}.out"), (2, f"{rank}.err")):
        file = os.open(os.path.join(logs, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own streams)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.argv = [target, *map(str, args)]
    if env.get("PYTHONWARNINGS") == "ignore":  # read at interpreter start, which a fork skips
        warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    code = 1
    try:
        result = _resolve(target)(list(args))
        code = result if isinstance(result, int) else 0
    except SystemExit as err:
        code = _exit_code(err)
    except BaseException:
        traceback.print_exc()
    finally:  # leave as the entrypoint does: no interpreter teardown (gloo threads)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _world(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun --standalone exports to worker `rank` of `nproc` on one node."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": "1",
    }


def _wait(procs: list, timeout: float) -> bool:
    """Wait for every rank; after a failure, SIGTERM the rest and SIGKILL them after the grace.
    Returns False when `timeout` ran out first (every rank is killed)."""
    deadline, kill_at = time.monotonic() + timeout, None
    while running := [p for p in procs if p.exitcode is None]:
        now = time.monotonic()
        if now >= deadline:
            for p in running:
                p.kill()
                p.join()
            return False
        if kill_at is None and any(p.exitcode not in (None, 0) for p in procs):
            kill_at = now + TERM_GRACE_S
            for p in running:
                p.terminate()
        elif kill_at is not None and now >= kill_at:
            for p in running:
                p.kill()
        multiprocessing.connection.wait([p.sentinel for p in running], timeout=0.1)
    return True


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""  # a rank killed before it began


def run_ranks(
    target: str, args: list, *, nproc: int, cwd: Path, env: dict[str, str], timeout: float = 600
) -> subprocess.CompletedProcess:
    """`target` ("module:function") called with the list `args` on each of `nproc` forked ranks; see the
    module's docstring. Raises TimeoutError, with the ranks' output, after `timeout` seconds."""
    ctx, store = _context(), agent_store(nproc)
    STARTED["jobs"] += 1
    STARTED["ranks"] += nproc
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        procs = [
            ctx.Process(target=_rank_main, args=(target, list(args), _world(r, nproc, store.port), str(cwd), env, logs))
            for r in range(nproc)
        ]
        for p in procs:
            p.start()
        finished = _wait(procs, timeout)
        out, err = ("".join(_read(Path(logs, f"{r}.{kind}")) for r in range(nproc)) for kind in ("out", "err"))
    if not finished:
        raise TimeoutError(f"{target} {args} on {nproc} ranks: not done after {timeout} s\n{err[-4000:]}")
    return subprocess.CompletedProcess([target, *map(str, args)], job_exit_code([p.exitcode for p in procs]), out, err)


def job_exit_code(codes: list[int]) -> int:
    """What `python -m sdp.train --nproc-per-node=N` (sdp.launching.torchrun) exits with: 0 when every rank
    returned 0, else the code of the lowest rank that exited on its own with one (2, 3, 130...),
    else 128 + the signal that stopped the lowest failed rank."""
    own = [c for c in codes if c and c > 0]
    if own:
        return own[0]
    stopped = [c for c in codes if c]
    return 128 - stopped[0] if stopped else 0
