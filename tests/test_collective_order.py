"""The collective-order checker itself: it accepts orders NCCL can run and rejects the others."""

from collective_order import order_problems

A, B, C = [0, 1], [1, 2], [0, 2]


def test_subsequences_of_one_order_pass():
    # Global order A0, B0, C0, world: each rank issues the part it takes part in.
    traces = [
        [[A, "g", 0], [C, "g", 0], ["world", "s", 0]],
        [[A, "g", 0], [B, "g", 0], ["world", "s", 0]],
        [[B, "g", 0], [C, "g", 0], ["world", "s", 0]],
    ]
    assert order_problems(traces, world_size=3) == []


def test_a_cycle_across_groups_is_found():
    # Rank 0: A then C; rank 1: B then A; rank 2: C then B: each waits for the next one.
    traces = [
        [[A, "g", 0], [C, "g", 0]],
        [[B, "g", 0], [A, "g", 0]],
        [[C, "g", 0], [B, "g", 0]],
    ]
    problems = order_problems(traces, world_size=3)
    assert len(problems) == 1 and problems[0].startswith("no global order: 3 collectives")


def test_a_direct_inversion_is_found():
    # Ranks 1 and 2 share B and the world, and issue them in opposite orders.
    traces = [[["world", "s", 0]], [[B, "g", 0], ["world", "s", 0]], [["world", "s", 0], [B, "g", 0]]]
    assert order_problems(traces, world_size=3)[0].startswith("no global order")


def test_members_that_disagree_within_a_group_are_found():
    traces = [[[A, "g", 0], [A, "g", 1]], [[A, "g", 1], [A, "g", 0]], []]
    problems = order_problems(traces, world_size=3)
    assert problems and problems[0].startswith("group (0, 1): rank 1 issued")


def test_a_collective_of_a_group_the_rank_is_not_in_is_found():
    assert order_problems([[[B, "g", 0]], [[B, "g", 0]], [[B, "g", 0]]], world_size=3)[0].startswith(
        "rank 0 issued a collective of group (1, 2)"
    )
