"""Memory figures the commands print say GiB (2**30 bytes): sdp.train's last line and the demo's
table, read from a recorded run of the language table."""

import re
from pathlib import Path

from sdp.launching.variants import Result, comparison_table
from sdp.run.outcome import print_result
from sdp.rundir.summary import read_summary

RUN = Path(__file__).parents[1] / "results/cpu_replica/runs/language/grid/ddp/002-optim.lr_0.006"


def test_sdp_trains_last_line_gives_memory_in_gib(capsys):
    summary = read_summary(RUN)
    print_result(summary)
    line = capsys.readouterr().out
    static, peak = re.search(r"params\+grads\+optim (\S+) GiB/rank, live peak (\S+) GiB/rank, comm", line).groups()
    assert float(static) == round(summary.static_bytes / 2**30, 4) and float(static) > 0
    assert float(peak) == round(summary.memory["peak_bytes"] / 2**30, 4) and float(peak) > 0
    assert "MiB/rank" not in line


def test_the_demo_table_gives_memory_in_gib():
    summary = read_summary(RUN)
    head, _, row = comparison_table([Result("DDP", RUN, 1.0, summary)]).splitlines()
    columns = [c.strip() for c in head.split("|")][1:-1]
    cells = dict(zip(columns, [c.strip() for c in row.split("|")][1:-1], strict=True))
    assert cells["params+grads+optim GiB/rank"] == f"{summary.static_bytes / 2**30:.4f}"
    assert cells["live peak GiB/rank"] == f"{summary.memory['peak_bytes'] / 2**30:.4f}"
