"""The package's shape: imports that run one way, and functions short enough to read.

Read from the source with `ast`, so an import inside a function counts like any other: one
placed there to dodge a cycle is still a cycle here.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src" / "sdp"

# A layer imports only from the layers before it (and from the shared modules below every layer:
# errors, dist, paths, optim, redact, and the folders data/ and metrics/). The folders say what
# they hold: models, their data-parallel wrappers, SDP, the outer loop over either, a run (and the
# files it writes), then what reads or plans runs, what launches them, and the commands a user types.
LAYERS = [
    ("sdp.models",),
    ("sdp.parallel",),
    ("sdp.subnet",),
    ("sdp.outer",),
    ("sdp.run", "sdp.rundir"),
    ("sdp.planning", "sdp.analysis"),
    ("sdp.launching",),
    ("sdp.train", "sdp.estimate", "sdp.plan", "sdp.collect", "sdp.export"),
]
SHARED = ("sdp.errors", "sdp.dist", "sdp.paths", "sdp.optim", "sdp.redact", "sdp.data", "sdp.metrics")


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports, anywhere in its source. A module importing the
    package it belongs to (its `__init__`, for names defined there) is not an edge."""
    edges = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    found.add(target)
        edges[name] = found
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on.discard(w)
                component.append(w)
            on.discard(v)
            if component:
                out.append(sorted([v, *component]))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def folders(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph with every subpackage (sdp.subnet.*, sdp.models.*...) collapsed to itself."""

    def top(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:2]) if len(parts) > 1 and (SRC / parts[1]).is_dir() else m

    out: dict[str, set[str]] = {}
    for a, bs in edges.items():
        out.setdefault(top(a), set()).update(top(b) for b in bs if top(b) != top(a))
    return out


def layer_of(module: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in layer):
            return i
    return None


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph(modules())) == []


def test_no_folder_imports_itself_through_others():
    assert cycles(folders(import_graph(modules()))) == []


def test_imports_run_from_models_to_the_entrypoints():
    upward = []
    for module, targets in import_graph(modules()).items():
        mine = layer_of(module)
        for target in targets:
            theirs = layer_of(target)
            if theirs is not None and (mine is None or theirs > mine):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_every_module_has_a_place():
    """A new module sits in a layer's folder, is a command, or is named shared here: nothing is
    left out of the layering by being new."""
    shared = [m for m in modules() if any(m == s or m.startswith(s + ".") for s in SHARED)]
    assert [m for m in modules() if layer_of(m) is None and m not in shared and m != "sdp"] == []


def test_the_checks_find_what_they_look_for():
    """The checks above on graphs with a cycle and an upward import in them."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert folders({"sdp.subnet.x": {"sdp.parallel.y"}, "sdp.parallel.y": {"sdp.subnet.z"}}) == {
        "sdp.subnet": {"sdp.parallel"},
        "sdp.parallel": {"sdp.subnet"},
    }
    assert layer_of("sdp.models.llama") == 0 and layer_of("sdp.subnet.sharded") == 2 and layer_of("sdp.dist") is None


@pytest.mark.parametrize("source,expected", [
    ("from sdp.subnet.units import x", {"sdp.subnet.units"}),
    ("def f():\n    from sdp.train import main", {"sdp.train"}),
    ("from . import units", {"sdp.subnet.units"}),
])  # fmt: skip
def test_imports_inside_functions_and_relative_ones_count(tmp_path, monkeypatch, source, expected):
    mods = {
        "sdp.subnet.mask": tmp_path / "mask.py",
        "sdp.subnet.units": tmp_path / "u.py",
        "sdp.train": tmp_path / "t.py",
    }
    for path in mods.values():
        path.write_text("")
    mods["sdp.subnet.mask"].write_text(source)
    assert import_graph(mods)["sdp.subnet.mask"] == expected


LONGEST = 80


def long_functions(mods: dict[str, Path]) -> list[str]:
    """Functions longer than LONGEST lines (signature and docstring included) whose docstring
    does not say why they are."""
    out = []
    for path in mods.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST and "longer than" not in (ast.get_docstring(node) or "").lower():
                    out.append(f"{path.name}:{node.name} ({lines} lines)")
    return out


def test_no_function_is_longer_than_a_screen_or_two():
    assert long_functions(modules()) == []


def test_a_long_function_is_found(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(LONGEST))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n\ndef short():\n    pass\n")
    assert long_functions({"sdp.long": tmp_path / "long.py"}) == ["long.py:long (81 lines)"]
    (tmp_path / "long.py").write_text(f'def long():\n    """Longer than a screen: a table."""\n{body}')
    assert long_functions({"sdp.long": tmp_path / "long.py"}) == []


def test_the_entrypoints_import_only_what_they_use():
    """`import sdp.train` loads neither torchvision (and torch._dynamo with it), transformers nor
    timm: a run imports only what its model family and dataset use (each costs ~1 s a process);
    nor FSDP and DTensor, which only parallelism=fsdp uses.
    `import sdp.plan` loads none of the tracing machinery either (the estimator, DTensor, the FLOP
    counter, sympy: about 0.9 s), which a plan that reads its traces back never uses."""
    import subprocess
    import sys

    heavy = ("torchvision", "transformers", "timm", "torch._dynamo")
    tracing = ("sdp.planning.estimator", "torch.distributed.tensor", "torch.utils.flop_counter", "sympy")
    # FSDP and DTensor (with distributed checkpointing) arrive with parallelism=fsdp only: 0.6 s.
    fsdp = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint")
    probe = (
        f"import sys, sdp.plan; print([m for m in {heavy + tracing!r} if m in sys.modules]); "
        f"import sdp.train; print([m for m in {heavy + fsdp!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "[]"]
