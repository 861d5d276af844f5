"""Bad input, drawn at random: every case stops before any process group, either accepted or
with one ConfigError that names a key (the entrypoint prints it as its one `error:` line), and
never with another exception (a traceback). Seeded and bounded: the same cases every run."""

import functools
import math
import random
import re
import signal
from dataclasses import fields, is_dataclass

import pytest

from sdp import dist
from sdp.errors import ConfigError
from sdp.run.config import group_options, typed_config
from sdp.run.preflight import preflight

CASES = 40  # random combinations; tests/test_fuzz_entrypoints.py draws every value class
CASE_LIMIT_S = 10
GROUPS = ("model", "dataset", "masking", "parallelism", "optim", "logger", "variant", "experiment", "debug")
# Values a numeric key may be given by mistake: zero, negative, fractional, huge, not finite.
BAD_NUMBERS = (0, -1, -3, 0.5, -0.25, 1.5, 7, 10**12, 1e-12, float("nan"), float("inf"), -float("inf"))
WORLD_SIZES = (1, 2, 3, 4, 8)
OFFLINE_TEXT, OFFLINE_IMAGES = ("synthetic_text", "local_text"), ("synthetic_image", "fashion_mnist")
# Keys that name where the run writes: drawn from the tmp dir instead (nothing else is written).
PLACES = ("run_dir", "output_root", "dataset.cache_dir", "dataset.path", "dataset.tokenizer")
KEY = re.compile(r"^[a-z_][a-z0-9_.]*(\[\d+\])?=")


def numeric_keys(node, prefix: str = "") -> list[str]:
    """The dotted keys of a typed config whose values are numbers (bools excluded)."""
    out = []
    for f in fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            out += numeric_keys(value, key + ".")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out.append(key)
    return out


@functools.cache
def keys_of(group: str, option: str | None) -> tuple[str, ...]:
    """The numeric keys a group's option brings (composed once per option; None: the default)."""
    own = [f"{group}={option}"] if option else []
    partners = ([], ["model=llama_tiny", "dataset=synthetic_text"], ["model=resnet_tiny", "dataset=synthetic_image"])
    for partner in partners:
        try:  # a text dataset needs a text model, and the other way round
            cfg = typed_config([*(o for o in partner if not o.startswith(group + "=")), *own])
            break
        except ConfigError:
            continue
    else:
        return ()
    node = getattr(cfg, group)
    return tuple(f"{group}.{k}" for k in numeric_keys(node)) if is_dataclass(node) else ()


def draw(rng: random.Random, tmp_path) -> tuple[list[str], int]:
    """One case: a random option of some groups, then out-of-range values for a few numeric keys
    (of the options drawn, the defaults' otherwise, and the trainer's and top-level ones)."""
    chosen = {g: rng.choice(group_options(g)) for g in GROUPS if rng.random() < 0.5}
    chosen["model"] = rng.choice(group_options("model"))
    if rng.random() < 0.8:  # mostly a dataset the model can train on and that is here offline
        chosen["dataset"] = rng.choice(OFFLINE_TEXT if chosen["model"].startswith("llama") else OFFLINE_IMAGES)
    overrides = [f"{g}={o}" for g, o in chosen.items()] + [f"output_root={tmp_path / 'outputs'}"]
    keys = [k for g in ("model", "dataset", "masking", "parallelism", "optim") for k in keys_of(g, chosen.get(g))]
    keys += [*keys_of("trainer", None), "seed"]
    keys = [k for k in keys if not k.startswith(PLACES)]
    for key in rng.sample(keys, k=rng.randint(0, 3)):
        value = rng.choice(BAD_NUMBERS)
        shown = "nan" if isinstance(value, float) and math.isnan(value) else str(value)
        overrides.append(f"{key}={shown}")
    return overrides, rng.choice(WORLD_SIZES)


class Hung(BaseException):  # not an Exception: no library code may turn it into an error
    pass


def _hung(signum, frame):
    raise Hung(f"no verdict within {CASE_LIMIT_S} s")


def run_cases(tmp_path) -> dict[str, int]:
    """Every case through the entrypoint's checks; how many were accepted and refused."""
    rng, outcomes = random.Random(16), {"accepted": 0, "refused": 0}
    for case in range(CASES):
        overrides, world_size = draw(rng, tmp_path)
        world = dist.World(rank=0, local_rank=0, world_size=world_size)
        signal.alarm(CASE_LIMIT_S)  # a check that hangs on a huge value is a failure too
        try:
            preflight(overrides, world)
        except ConfigError as err:
            assert KEY.match(str(err)) and "\n" not in str(err), (case, overrides, str(err))
            outcomes["refused"] += 1
        except (Exception, Hung) as err:  # noqa: BLE001 - the failure this test exists to find
            pytest.fail(f"case {case} (world {world_size}): {overrides} raised {type(err).__name__}: {err}")
        else:
            outcomes["accepted"] += 1
        finally:
            signal.alarm(0)
    return outcomes


def test_random_bad_input_ends_in_one_line_naming_a_key(tmp_path, monkeypatch):
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "cache"))
    previous = signal.signal(signal.SIGALRM, _hung)
    try:
        outcomes = run_cases(tmp_path)
    finally:
        signal.signal(signal.SIGALRM, previous)
    # Both outcomes occur: the cases are neither all trivially bad nor all harmless.
    assert min(outcomes.values()) >= CASES // 20, outcomes
    assert not (tmp_path / "outputs").exists()  # nothing written
