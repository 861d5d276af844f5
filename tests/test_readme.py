"""The README's results tell the tables' story: every figure a result line quotes is in the tables
it cites, rounded as written. A stale line (a table re-made, the line not) fails here."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
# A number as the README and the tables write it: thousands separated by commas, a decimal part.
NUMBER = re.compile(r"(?<![\w/.])[−-]?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?")


def figures(text: str) -> list[tuple[float, int, str]]:
    """Every number of `text` as (its magnitude, its decimals, as written)."""
    out = []
    for m in NUMBER.finditer(text):
        whole, decimals = m.group(1).replace(",", ""), m.group(2) or ""
        out.append((float(f"{whole}.{decimals}" if decimals else whole), len(decimals), m.group(0)))
    return out


def quoted(value: float, decimals: int, pool: set[float]) -> bool:
    """Whether a figure written with `decimals` decimals is one of the tables' values rounded so:
    the value itself, as a percentage (a share), or as a percentage above or below 1 (a ratio)."""
    return any(round(abs(candidate), decimals) == value for y in pool for candidate in (y, 100 * y, 100 * (y - 1)))


def result_lines(readme: str) -> list[str]:
    section = readme.split("\n## Results")[1].split("\n## ")[0]
    return [line for line in section.splitlines() if line.startswith("- **")]


def stale(line: str, root: Path = ROOT) -> list[str]:
    """The figures with decimals of a result line that none of the tables it links (files under
    results/) holds; [] for a line that links none."""
    links = [link.split("#")[0] for link in re.findall(r"\]\(([^)]+)\)", line)]
    tables = [root / link for link in links if link.startswith("results/") and link.endswith((".md", ".csv"))]
    if not tables:
        return []
    pool = {value for table in tables for value, _, _ in figures(table.read_text())}
    prose = re.sub(r"\]\([^)]*\)", "]", line)  # link targets are paths, not figures
    return [raw for value, decimals, raw in figures(prose) if decimals and not quoted(value, decimals, pool)]


def test_every_result_line_quotes_its_tables():
    lines = result_lines((ROOT / "README.md").read_text())
    cited = [line for line in lines if "](results/" in line]
    assert len(cited) >= 10  # the section was found, and most lines cite a table
    for line in cited:
        for link in re.findall(r"\]\((results/[^)#]+)", line):
            assert (ROOT / link).exists(), link
    problems = {line[4 : line.index("**", 4)]: stale(line) for line in cited}
    assert {name: figures for name, figures in problems.items() if figures} == {}


def test_a_stale_line_is_caught():
    # The memory line: the estimate 1.2 to 3.4% above CUDA's peak (the table's estimate / CUDA
    # ratios, 1.012 to 1.034), llama_1b's N-SDP forward at -41.1% of DDP's peak. A figure the
    # table does not hold is reported; one the table holds elsewhere (by chance) would pass.
    line = (
        "- **Memory, measured** on one H200 ([results](results/bench/cuda_memory_h200.md)): the estimate "
        "was 1.2 to 3.4% above CUDA's peak; `llama_1b` N-SDP forward at C = 0.5 is −41.1%."
    )
    assert stale(line) == []
    assert stale(line.replace("−41.1%", "−41.7%")) == ["−41.7"]
    assert stale(line.replace("3.4%", "3.9%")) == ["3.9"]
    assert stale(line.replace("(results/bench/cuda_memory_h200.md)", "(docs/memory.md)")) == []  # cites no table
