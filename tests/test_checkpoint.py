"""Checkpoint integrity in one process: manifests and checksums, a damaged newest checkpoint
falls back to the one before, a full disk keeps the previous one, a diverged or reshaped
state is refused; and, on two forked ranks, a save issues the same collectives on every rank
whatever each rank's IO did. The multi-process faults (a killed rank, NaNs) are in test_faults.py."""

import contextlib
import errno
import json
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d
from conftest import job_env
from ranks import run_ranks
from torch import nn

from sdp import dist
from sdp.metrics.comm import CommCounter
from sdp.parallel import ParallelConfig
from sdp.parallel.ddp import DDPStrategy
from sdp.run.checkpoint import CheckpointTarget, SavedState, complete_checkpoints, write_checkpoint
from sdp.run.resume import check_resume, choose_checkpoint, load_checkpoint

CONFIG = {"model": {"name": "tiny"}, "trainer": {"max_steps": 10}}
WORLD = dist.World(rank=0, local_rank=0, world_size=1)
CPU = torch.device("cpu")


def _trainer(seed: int = 0, width: int = 8):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    strategy = DDPStrategy(model, ParallelConfig(), device=CPU, comm=CommCounter(CPU))
    return strategy, optimizer, scheduler


def _save(run_dir, step, trainer, keep=2):
    strategy, optimizer, scheduler = trainer
    target = CheckpointTarget(run_dir, config=CONFIG, keep=keep)
    return write_checkpoint(target, SavedState(strategy, optimizer, scheduler, world=WORLD, device=CPU), step=step)


def _choose(run_dir):
    return choose_checkpoint(check_resume(run_dir, CONFIG), world=WORLD)


def test_a_checkpoint_has_a_manifest_of_its_files(tmp_path, group):
    path = _save(tmp_path, 4, _trainer())
    meta = json.loads((path / "meta.json").read_text())
    entry = meta["files"]["rank00000.pt"]
    assert entry["bytes"] == (path / "rank00000.pt").stat().st_size and len(entry["sha256"]) == 64
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004"]


@pytest.mark.parametrize("harm", ["truncate", "flip_a_byte", "delete", "garble_meta"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, group, harm):
    trainer = _trainer()
    _save(tmp_path, 2, trainer)
    newest = _save(tmp_path, 4, trainer)
    data = newest / "rank00000.pt"
    size = data.stat().st_size
    if harm == "truncate":  # a write cut short
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif harm == "flip_a_byte":  # bit rot: same size, other content
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif harm == "delete":
        data.unlink()
    else:
        (newest / "meta.json").write_text('{"step": 4, "world_si')
    ckpt, problems = _choose(tmp_path)
    assert ckpt.step == 2
    expected = {
        "truncate": f"rank00000.pt has {size // 2} bytes, its manifest says {size}",
        "flip_a_byte": "does not match its SHA-256 checksum",
        "delete": "rank00000.pt is missing",
        "garble_meta": "meta.json is unreadable",
    }[harm]
    assert len(problems) == 1 and "step_00000004" in problems[0] and expected in problems[0], problems


def test_no_intact_checkpoint_refuses_the_resume_naming_each_damage(tmp_path, group):
    from sdp.errors import RunFailed
    from sdp.run.runner import pick_checkpoint

    older = _save(tmp_path, 2, _trainer())
    newest = _save(tmp_path, 4, _trainer())
    (newest / "rank00000.pt").write_bytes(b"")
    meta = json.loads((older / "meta.json").read_text())
    del meta["files"]  # a checkpoint without a manifest cannot be checked: not trusted
    (older / "meta.json").write_text(json.dumps(meta))
    ckpt, problems = _choose(tmp_path)
    assert (
        ckpt is None and "has 0 bytes" in problems[0] and "step_00000002/meta.json has no file manifest" in problems[1]
    )
    with pytest.raises(RunFailed, match=r"run_dir holds no intact checkpoint to resume from \(step_00000004/rank"):
        pick_checkpoint(check_resume(tmp_path, CONFIG), world=WORLD)


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, group, monkeypatch, capsys):
    trainer = _trainer()
    _save(tmp_path, 2, trainer)
    real_save = torch.save

    def disk_full(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.truncate(100)  # part of it reached the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    assert _save(tmp_path, 4, trainer) is None
    warning = capsys.readouterr().err
    part = tmp_path / "checkpoints" / "step_00000004.partial" / "rank00000.pt"
    assert warning.startswith(f"warning: checkpoint of step 4 not written (rank 0: {part}: no space left on device, ")
    assert "kept step_00000002" in warning and warning.count("\n") == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]
    monkeypatch.setattr(torch, "save", real_save)
    assert _choose(tmp_path)[0].step == 2
    assert _save(tmp_path, 6, trainer) is not None  # space again: the next checkpoint is written


def test_a_diverged_state_is_not_saved(tmp_path, group, capsys):
    trainer = _trainer()
    _save(tmp_path, 2, trainer)
    with torch.no_grad():
        trainer[0].plain[0].weight[0, 0] = float("nan")
    assert _save(tmp_path, 4, trainer) is None
    assert "0.weight is not finite" in capsys.readouterr().err
    assert [c.step for c in complete_checkpoints(tmp_path)] == [2]


def test_only_the_newest_keep_are_kept_and_partial_dirs_are_ignored(tmp_path, group):
    trainer = _trainer()
    for step in (2, 4, 6):
        _save(tmp_path, step, trainer, keep=2)
    (tmp_path / "checkpoints" / "step_00000008.partial").mkdir()  # a launch died while writing it
    (tmp_path / "checkpoints" / "step_00000008.partial" / "meta.json").write_text('{"step": 8}')
    assert [c.step for c in complete_checkpoints(tmp_path)] == [4, 6]


def test_a_checkpoint_loads_bitwise_and_refuses_another_shape(tmp_path, group):
    saved = _trainer(seed=1)
    ckpt_dir = _save(tmp_path, 2, saved)
    ckpt = complete_checkpoints(tmp_path)[-1]
    assert ckpt.path == ckpt_dir
    strategy, optimizer, scheduler = _trainer(seed=2)
    load = dict(world=WORLD, device=CPU, seed=0)
    load_checkpoint(ckpt, strategy=strategy, optimizer=optimizer, scheduler=scheduler, **load)
    for a, b in zip(saved[0].model.parameters(), strategy.model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(saved[1].state.values(), optimizer.state.values(), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert optimizer.param_groups[0]["lr"] == saved[1].param_groups[0]["lr"]
    wider = _trainer(width=16)
    with pytest.raises(RuntimeError, match=r"does not fit this run's model: .*size mismatch for 0.weight"):
        load_checkpoint(ckpt, strategy=wider[0], optimizer=wider[1], scheduler=wider[2], **load)


# The checkpoints saved by the job of test_every_rank_issues_the_same_collectives_whatever_its_io_did,
# and what fails in each with a full disk: (rank, what).
FAULTS = {2: None, 4: (1, "write"), 6: (0, "write"), 8: (0, "partial dir"), 10: (0, "commit")}
COLLECTIVES = (
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


def _record_collectives(trace: list) -> None:
    """From now on every torch.distributed collective this process issues is appended to `trace`
    by name: the outermost call only (an object collective's own tensor collectives are part of it)."""
    depth = [0]

    def recorder(name, real):
        def recorded(*args, **kwargs):
            if depth[0] == 0:
                trace.append(name)
            depth[0] += 1
            try:
                return real(*args, **kwargs)
            finally:
                depth[0] -= 1

        return recorded

    for module in (tdist, c10d):
        for name in COLLECTIVES:
            if hasattr(module, name):
                setattr(module, name, recorder(name, getattr(module, name)))


def _full_disk(what: str):
    """`what` of a checkpoint fails on this rank as on a full disk."""
    full = OSError(errno.ENOSPC, "No space left on device")
    return {
        "write": mock.patch.object(torch, "save", side_effect=full),
        "partial dir": mock.patch.object(Path, "mkdir", side_effect=full),
        "commit": mock.patch("sdp.run.checkpoint.write_json_atomic", side_effect=full),
    }[what]


def save_and_record(argv: list[str]) -> int:
    """One forked rank (tests/ranks.py) of the job of the test below: the checkpoints of FAULTS,
    each with its fault on its rank, into ./run; what each save returned and the collectives it
    issued go to ./trace_RANK.json."""
    tdist.init_process_group("gloo", timeout=timedelta(seconds=20))  # a mismatch fails instead of hanging
    rank = tdist.get_rank()
    world = dist.World(rank=rank, local_rank=rank, world_size=tdist.get_world_size())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))  # buffers: rank 0's are saved
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    strategy = DDPStrategy(model, ParallelConfig(), device=CPU, comm=CommCounter(CPU))
    trace, out = [], {}
    _record_collectives(trace)
    for step, fault in FAULTS.items():
        trace.clear()
        mine = fault is not None and fault[0] == rank
        with _full_disk(fault[1]) if mine else contextlib.nullcontext():
            try:
                state = SavedState(strategy, optimizer, scheduler, world=world, device=CPU)
                path = write_checkpoint(CheckpointTarget(Path("run"), config=CONFIG, keep=2), state, step=step)
                returned = None if path is None else path.name
            except Exception as err:  # noqa: BLE001 - a mismatched collective: recorded for the test
                returned = f"raised {type(err).__name__}: {err}"
        out[step] = {"collectives": list(trace), "returned": returned}
        if returned and returned.startswith("raised"):
            break  # the group is broken
    Path(f"trace_{rank}.json").write_text(json.dumps(out))
    return 0


def test_every_rank_issues_the_same_collectives_whatever_its_io_did(tmp_path):
    # With NCCL a rank that issues other collectives than the others, or in another order, hangs
    # the job. Two ranks save five checkpoints: all written, then rank 1's part failing, rank
    # 0's, rank 0's partial directory, rank 0's commit (meta.json). Every save issues the same
    # collectives on both ranks, whichever rank's IO failed and wherever.
    proc = run_ranks("test_checkpoint:save_and_record", [], nproc=2, cwd=tmp_path, env=job_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"trace_{r}.json").read_text()) for r in range(2)]
    written = ranks[0]["2"]["collectives"]
    for step, fault in FAULTS.items():
        issued = [saves.get(str(step), {}).get("collectives") for saves in ranks]
        assert issued == [written, written], (
            f"checkpoint of step {step}, full disk at {fault}: rank 0 issued {issued[0]}, rank 1 {issued[1]}; "
            f"with every write done: {written}"
        )
    # The portable state's (rank 0's BatchNorm buffers), then: agree on the writes, rank 0's verdict, the barrier.
    assert "broadcast" in written and written[-3:] == ["all_gather_object", "broadcast_object_list", "barrier"]
    returned = {r: {int(step): save["returned"] for step, save in saves.items()} for r, saves in enumerate(ranks)}
    want = {2: "step_00000002", 4: None, 6: None, 8: None, 10: None}
    assert returned == {0: want, 1: want}, returned
    for step, fault in FAULTS.items():
        if fault is not None:
            assert f"warning: checkpoint of step {step} not written (rank {fault[0]}: " in proc.stderr
    assert [c.step for c in complete_checkpoints(tmp_path / "run")] == [2]
