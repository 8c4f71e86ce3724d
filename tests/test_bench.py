"""The solver benchmark in its CI size: every row at least as fast as the grid's best."""

import csv
import json

from autopar.cli import main
from autopar.commands.bench import QUICK_ROWS


def test_quick_bench_rows_are_never_worse_than_the_grid(tmp_path, capsys):
    assert main(["bench", "--quick", "--json", "--out", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == len(QUICK_ROWS)
    for row in rows:
        assert row["ratio"] >= 1.0 - 1e-12, row
        assert row["autopar_step_s"] <= row["grid_step_s"]
        assert row["grid_configs"] > 10 and row["solve_s"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    with (tmp_path / "bench.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == len(rows)
    assert (tmp_path / "bench.md").read_text().count("\n") == len(rows) + 2
