"""The distributed plumbing's failure diagnosis (sdp.dist): which errors are a collective that
lost a peer, how one is named, and the roll call through the job's store."""

import pytest
import torch.distributed as tdist

from sdp import dist
from sdp.run.outcome import peer_lost


def raised(err: BaseException) -> BaseException:
    """`err` as raised, with its traceback."""

    def throw():
        raise err

    return raised_from(throw)


@pytest.mark.parametrize(
    "err",
    [ValueError("timed out"), RuntimeError("CUDA out of memory"), RuntimeError("timed out reading the dataset")],
)
def test_errors_that_are_not_a_lost_peer_are_left_alone(err):
    assert dist.failed_collective(raised(err)) is None


def test_a_lost_peer_is_named_by_the_collective_and_the_place_that_issued_it(group, monkeypatch):
    assert dist.failed_collective(raised(tdist.DistBackendError("NCCL communicator was aborted"))) == "a collective"
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation")
    assert dist.failed_collective(raised(gloo)) == "a collective"

    # From inside a real collective: the API this package called, and where.
    def timed_out(*args, **kwargs):
        raise RuntimeError("[gloo] Timed out waiting 20000ms for send operation to complete")

    monkeypatch.setattr(tdist.distributed_c10d, "broadcast", timed_out)  # what broadcast_object_list calls
    err = raised_from(lambda: dist.broadcast_object(1))
    assert dist.failed_collective(err) == "broadcast_object_list (from sdp.dist.broadcast_object)"


def raised_from(fn) -> BaseException:
    """What `fn()` raises, with its traceback (the traceback is what is tested)."""
    try:
        fn()
    except BaseException as caught:  # noqa: BLE001
        return caught
    raise AssertionError("nothing raised")


def test_the_roll_call_names_the_ranks_that_did_not_report(monkeypatch):
    world = dist.World(rank=0, local_rank=0, world_size=3)
    store = tdist.HashStore()
    monkeypatch.setattr(dist, "_CONTROL", store)
    store.set("failed/2", "1")  # rank 2 reported its own failure; rank 1 never does
    assert dist.roll_call(world, wait_s=0.5) == [0, 2]
    lost = peer_lost(
        "all_reduce (from sdp.run.signals.StopSignals.__call__)",
        RuntimeError("Timed out waiting 20000ms"),
        world=world,
        timeout_s=20,
        run_dir=None,
    )
    assert str(lost) == (
        "rank 1 stopped responding: rank 0 got no reply within parallelism.timeout_s=20 in all_reduce "
        "(from sdp.run.signals.StopSignals.__call__); no checkpoint was written yet"
    )
    assert lost.reporter  # the lowest rank that reported
    monkeypatch.setattr(dist, "_CONTROL", None)  # no store to ask: this rank reports
    assert dist.roll_call(world, wait_s=0.5) is None


def test_a_fake_process_group_leaves_the_excepthook_as_it_found_it():
    # torch's init_process_group wraps sys.excepthook with a "[rankN]: " prefix and never unwraps
    # it: a process tracing many ranks (the planner) stacked one prefix per group.
    import sys

    before = sys.excepthook
    for rank in (0, 3):
        with dist.fake_process_group(rank, 4):
            assert sys.excepthook is not before
    assert sys.excepthook is before and not tdist.is_initialized()
