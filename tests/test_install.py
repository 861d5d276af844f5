"""Installable like a library: a wheel built from the tree carries the configs, and its console
scripts run from outside the source tree with nothing of src/ or conf/ on any path."""

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import job_env

REPO = Path(__file__).parents[1]
SCRIPTS = {
    "sdp-train": "sdp-train = sdp.train:cli",
    "sdp-estimate": "sdp-estimate = sdp.estimate:main",
    "sdp-plan": "sdp-plan = sdp.plan:cli",
    "sdp-collect": "sdp-collect = sdp.collect:main",
    "sdp-export": "sdp-export = sdp.export:cli",
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """The wheel installed (--no-deps) into a directory of its own; the environment that runs
    it: that directory, then this venv's site-packages for the dependencies."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"  # a copy: building writes build/ and *.egg-info/ next to the sources
    for tree in ("src", "conf"):
        shutil.copytree(REPO / tree, source / tree, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "wheels"), str(source)]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "wheels").glob("sdp-*.whl")
    target = tmp / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, timeout=300)
    # No `site` (python -S): the editable install's .pth, which puts src/ on the path, is not read.
    env = job_env(PYTHONPATH=f"{target}:{sysconfig.get_paths()['purelib']}")
    return wheel, {"target": target, "env": env, "work": tmp / "elsewhere"}


def _run(installed, script: str, *args: str) -> subprocess.CompletedProcess:
    _, where = installed
    where["work"].mkdir(exist_ok=True)
    cmd = [sys.executable, "-S", str(where["target"] / "bin" / script), *args]
    return subprocess.run(cmd, cwd=where["work"], env=where["env"], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_wheel_carries_every_config_and_module(installed):
    """conf/ at the top of the repository becomes the package's sdp/conf/; every module of every
    folder of src/sdp/ is in it (pyproject.toml lists the packages: a new folder must be added)."""
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"sdp/conf/{p.relative_to(REPO / 'conf')}" for p in (REPO / "conf").rglob("*.yaml")}
    modules = {str(p.relative_to(REPO / "src")) for p in (REPO / "src" / "sdp").rglob("*.py")}
    assert len(configs) > 40 and len(modules) > 60
    assert sorted(configs - names) == [] and sorted(modules - names) == []
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    for script in SCRIPTS.values():
        assert script in entry_points


@pytest.mark.slow
def test_the_console_scripts_run_outside_the_source_tree(installed):
    _, where = installed
    probe = subprocess.run(
        [sys.executable, "-S", "-c", "import sdp, sys; print(sdp.__file__); print(*sys.path, sep='\\n')"],
        cwd=REPO.parent,
        env=where["env"],
        capture_output=True,
        text=True,
    )
    module, *path = probe.stdout.splitlines()
    sources = (str(REPO / "src"), str(REPO / "conf"))
    assert module.startswith(str(where["target"])) and not any(p.startswith(sources) for p in path), probe.stdout
    for script in SCRIPTS:  # each answers --help with its usage, its keys and examples
        helped = _run(installed, script, "--help")
        assert helped.returncode == 0 and helped.stdout.startswith("usage: "), helped.stderr[-2000:]
        assert "xamples:" in helped.stdout and helped.stderr == "", (script, helped.stderr[-2000:])
        if script == "sdp-train":
            assert "demo_fmnist" in helped.stdout
            assert f"the defaults: {where['target']}/sdp/conf/config.yaml" in helped.stdout
    ran = _run(installed, "sdp-train", "debug=fast", "dataset=synthetic_image", "run_dir=runs/fast")
    assert ran.returncode == 0 and "run dir: runs/fast" in ran.stdout, ran.stderr[-2000:]
    estimated = _run(installed, "sdp-estimate", "model=llama_tiny", "dataset=synthetic_text", "world_size=2")
    assert estimated.returncode == 0 and "params" in estimated.stdout, estimated.stderr[-2000:]
    collected = _run(installed, "sdp-collect", "runs", "--out", "tables")
    assert collected.returncode == 0 and (where["work"] / "tables").is_dir(), collected.stderr[-2000:]
