"""Every command answers --help (and -h) with its usage, its keys and examples, exit 0, and starts
nothing; the examples it prints are valid command lines (composed and checked, not run)."""

import shlex

import pytest

import sdp.estimate
import sdp.plan
from sdp import collect, export, train
from sdp.planning.options import parse_against, parse_estimate
from sdp.planning.planner import prepare
from sdp.run.config import load_config

COMMANDS = {
    "train": train.main,
    "estimate": sdp.estimate.main,
    "plan": sdp.plan.main,
    "collect": collect.main,
    "export": export.main,
}


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_prints_its_usage_keys_and_examples(name, flag, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = COMMANDS[name]([flag] if name == "collect" else ["model=llama_tiny", flag])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert out.startswith("usage: ") and "xamples:" in out, out
    assert list(tmp_path.iterdir()) == []  # nothing written


def _examples(text: str, command: str) -> list[list[str]]:
    return [shlex.split(line)[3:] for line in text.splitlines() if line.strip().startswith(f"python -m {command} ")]


def test_the_estimators_examples_compose_and_pass_its_checks():
    examples = _examples(sdp.estimate.USAGE.text(), "sdp.estimate")
    assert len(examples) == 3
    against = [argv for argv in examples if argv[0] == "--against"]
    assert [parse_against(argv)[1:] for argv in against] == [("all", None)]
    for argv in [argv for argv in examples if argv not in against]:
        args = parse_estimate(argv)
        load_config(args.overrides, world_size=args.world_size, offline=True, check_data=False)


def test_the_planners_examples_pass_its_checks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    examples = _examples(sdp.plan.USAGE.text(), "sdp.plan")
    assert len(examples) == 2
    for argv in examples:
        prepare(argv)  # every refusal of a bad input, before any trace


def test_export_without_a_run_dir_says_what_it_needs(capsys):
    assert export.main([]) == 2
    assert capsys.readouterr().err == ("error: RUN_DIR=None: is required: python -m sdp.export RUN_DIR ... (--help)\n")
