"""Paths a user names and files a run dir holds, checked before anything is written or run:
an output place that cannot be written, a file that cannot be read. Each problem is one
ConfigError, which every entrypoint prints as its one `error: ...` line with exit code 2."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import yaml

from sdp.errors import ConfigError


def _conf_dir() -> Path:
    """The shipped configs: conf/ at the top of the repository in a source tree (and an editable
    install); a wheel installs the same files as the package's own conf/ (pyproject.toml)."""
    here = Path(__file__).resolve().parent
    return here / "conf" if (here / "conf").is_dir() else here.parents[1] / "conf"


CONF_DIR = _conf_dir()


class DamagedFile(ConfigError):
    """A file of a run dir (or one the user named) that cannot be read as what it should be:
    the line is `PATH: what is wrong`."""

    def __init__(self, path: Path, problem: str):
        problem = " ".join(problem.split())  # one line, whatever the library's message
        self.key, self.value, self.allowed = str(path), None, problem
        ValueError.__init__(self, f"{path}: {problem}")


def check_writable(key: str, path: Path) -> None:
    """Before anything is written: `path` is a directory this process can write in, or one it
    can create; else one ConfigError naming `key`. It probes by making (and removing) a
    directory in the nearest existing one, which is what the run will do: permissions, a
    read-only file system or a pseudo one (/proc) all show up, and nothing is left behind."""
    if path.exists() and not path.is_dir():
        raise ConfigError(key, str(path), "is a file, not a directory")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(key, str(path), f"cannot be created: {parent} is a file")
    probe = parent / f".sdp-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as err:
        raise ConfigError(key, str(path), f"cannot be created or written in: {err.strerror} (in {parent})") from None


def check_output_file(key: str, path: Path) -> None:
    """`path` is a file this process may write: not a directory or a device, in a directory it
    can write in (made if missing)."""
    if path.is_dir():
        raise ConfigError(key, str(path), "is a directory; give a file name")
    if path.exists() and not path.is_file():
        raise ConfigError(key, str(path), "is not a regular file (a device?); give a file name")
    check_writable(key, path.parent)


def describe(err: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def read_yaml_mapping(path: Path) -> dict:
    """A YAML file that must hold a mapping (a run's config.yaml); DamagedFile otherwise."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise DamagedFile(path, f"cannot be read as YAML ({describe(err)})") from None
    if not isinstance(data, dict):
        raise DamagedFile(path, f"holds {type(data).__name__}, not a mapping of config keys")
    return data


def read_json_lines(path: Path) -> list[dict]:
    """A JSON-lines file of objects (metrics.jsonl); DamagedFile naming the first bad line."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise DamagedFile(path, f"cannot be read ({describe(err)})") from None
    records = []
    for n, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError as err:
            raise DamagedFile(path, f"line {n} is not JSON ({describe(err)})") from None
        if not isinstance(record, dict):
            raise DamagedFile(path, f"line {n} holds {type(record).__name__}, not a record")
        records.append(record)
    return records
