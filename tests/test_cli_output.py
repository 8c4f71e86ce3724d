"""What the commands print and write: tables readable at 80 columns when piped (COLUMNS unset),
plan text shown literally (no console markup, no control characters), sizes in a unit that keeps
them non-zero, plots skipped with a note when matplotlib is missing, and output paths checked
before the work that fills them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.errors import format_bytes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_bad_input import plan_dict  # noqa: E402  (the suite's valid plan)

BLOCK_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; "


def piped(argv: list[str], prelude: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    """`autopar ARGV | cat` as a user runs it: stdout is a pipe, COLUMNS is unset."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    code = f"{prelude}from autopar.cli import main; sys.exit(main({argv!r}))"
    return subprocess.run([sys.executable, "-c", "import sys; " + code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_fits_80(text: str) -> None:
    for line in text.splitlines():
        assert len(line) <= 80, f"wider than 80 columns: {line!r}"
    assert "…" not in text, "a header or cell was cut"


def test_sizes_keep_a_leading_digit():
    assert format_bytes(3 * 2**30 // 2) == "1.50 GiB"
    assert format_bytes(946 * 2**10) == "946.00 KiB"
    assert format_bytes(5 * 2**20) == "5.00 MiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(2 * 2**40) == "2.00 TiB"


def test_out_of_memory_message_uses_a_nonzero_unit(capsys):
    assert main(["plan", "gpt:layers=1,hidden=32,heads=2,seq=8,vocab=64", "--mesh", "2:cpu",
                 "--global-batch", "4", "--memory-limit", "2KiB", "--time-limit", "30"]) == 1
    err = capsys.readouterr().err
    assert "no plan fits 2.00 KiB per device" in err
    assert "0.0 GiB" not in err and "0.00 GiB" not in err


def test_crafted_plan_text_is_printed_literally_and_fits(tmp_path):
    data = plan_dict()
    data["model_type"] = "[link=https://example.com]click[/link] \x1b[2J:cat:"
    data["stages"][0]["layers"] = ["[b]emb", "model.decoder.embed_positions_of_a_long_name"]
    data["solver"] = {"status": "[red]ok", "seconds": 2.5}
    path = tmp_path / "crafted.json"
    path.write_text(json.dumps(data))
    done = piped(["explain", str(path)])
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "[link=https://example.com]click[/link]" in out and "[b]emb" in out
    assert "\\x1b[2J:cat:" in out and "\x1b" not in out
    assert "solver: [red]ok in 2.500 s" in out
    assert_fits_80(out)
    # words where the plan holds numbers are refused on load (tests/test_plan_files.py)
    data["predicted"]["step_time_s"] = "fast"
    path.write_text(json.dumps(data))
    done = piped(["explain", str(path)])
    assert done.returncode == 1 and "predicted.step_time_s" in done.stderr


def test_diff_and_explain_fit_80_columns(tmp_path):
    a, b = tmp_path / "a-plan-with-a-long-file-name.json", tmp_path / "b.json"
    a.write_text(json.dumps(plan_dict()))
    changed = plan_dict()
    changed["stages"][1]["recompute"] = "selective"
    b.write_text(json.dumps(changed))
    for argv in (["explain", str(a)], ["diff", str(a), str(b)]):
        done = piped(argv)
        assert done.returncode == 0, done.stderr
        assert_fits_80(done.stdout)
    assert "stages[1].recompute" in done.stdout


@pytest.mark.parametrize("argv", [
    ["plan", "gpt-tiny", "--mesh", "2:cpu", "--global-batch", "8", "--out", "{tmp}/none/plan.json"],
    ["calibrate", "--out", "{tmp}"],
    ["bench", "--quick", "--out", "{tmp}/file"],
    ["explain", "{tmp}/plan.json", "--png", "{tmp}"],
    ["demo", "--png", "{tmp}/none/loss.png"],
])
def test_output_paths_are_checked_before_the_work(tmp_path, capsys, argv):
    (tmp_path / "file").write_text("x")
    (tmp_path / "plan.json").write_text(json.dumps(plan_dict()))
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and ("does not exist" in err or "is a folder" in err or "is a file" in err)


def test_explain_png_without_matplotlib_is_an_error_before_printing(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_dict()))
    done = piped(["explain", str(path), "--png", str(tmp_path / "t.png")], prelude=BLOCK_MATPLOTLIB)
    assert done.returncode == 1 and "needs matplotlib" in done.stderr and "Traceback" not in done.stderr


def test_bench_without_matplotlib_completes_and_says_so(tmp_path, capsys, monkeypatch):
    import autopar.commands.bench as bench

    monkeypatch.setattr(bench, "QUICK_ROWS", bench.QUICK_ROWS[2:])     # llama-tiny: one small row
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["bench", "--quick", "--out", str(tmp_path), "--time-limit", "30"]) == 0
    captured = capsys.readouterr()
    assert "bench.png skipped: drawing it needs matplotlib" in captured.err
    assert (tmp_path / "bench.md").exists() and not (tmp_path / "bench.png").exists()
    assert_fits_80(captured.out)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_demo_without_matplotlib_trains_compares_and_fits_80_columns(tmp_path):
    png = tmp_path / "loss.png"
    done = piped(["demo", "--steps", "2", "--png", str(png)], prelude=BLOCK_MATPLOTLIB, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the loss curves will not be drawn: that needs matplotlib" in done.stdout
    assert "largest difference" in done.stdout and not png.exists()
    assert_fits_80(done.stdout)


@pytest.mark.slow
def test_timeline_of_thousands_of_micro_batches_is_drawn(tmp_path):
    """One collection of boxes per rank and kind: 4096 micro-batches draw in seconds (drawing a
    box at a time took minutes, and explain --png of a large plan looked hung)."""
    data = plan_dict()
    data.update(micro_batches=4096, global_batch=2 * 4096 * 4)
    path, png = tmp_path / "plan.json", tmp_path / "t.png"
    path.write_text(json.dumps(data))
    done = piped(["explain", str(path), "--png", str(png)], timeout=200)
    assert done.returncode == 0, done.stderr
    assert png.stat().st_size > 10_000


def test_validate_table_fits_80_columns_without_cutting_names():
    from rich.console import Console

    from autopar.commands.validate import show

    rows = [{"name": "dp2 pp2 interleaved-1f1b v2", "config": object(), "predicted_s": 0.25,
             "measured_s": 0.28, "predicted_mib": 12.0, "measured_mib": 62.3},
            {"name": "tp4 rc-selective", "config": object(), "predicted_s": 3.8, "measured_s": 4.4,
             "predicted_mib": 4.7, "measured_mib": 62.3},
            {"name": "planner: pp4 1f1b", "config": None, "predicted_s": 0.08, "measured_s": 0.087,
             "measured_mib": 60.0}]
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    show(console, rows)
    text = console.export_text()
    assert_fits_80(text)
    assert "dp2 pp2 interleaved-1f1b v2" in text and "median |error| 12%" in text


def test_bench_table_keeps_every_header_word_whole_at_80_columns():
    from rich.console import Console

    from autopar.commands.bench import Row, table

    row = Row(model="gpt:layers=6,hidden=256,heads=8,seq=128,vocab=1024", cluster="128x8:a100-80g",
              global_batch=1536, grid_config="tp=8 pp=16 dp=8 interleaved-1f1b v=2 mbs=1 m=192 "
              "recompute=selective zero=1", grid_step_s=20.0, grid_tflops=150.2,
              grid_samples_per_s=76.8, autopar_plan="tp=4 pp=8 dp=32 zero-bubble v=4 mbs=1 m=48 "
              "recompute=none zero=1", autopar_step_s=18.2, autopar_tflops=181.3,
              autopar_samples_per_s=84.2, ratio=1.015, solve_s=7.3, capture_s=7.0, grid_configs=40,
              why="uneven stages (3/4/4/3 blocks: the embedding and head are not free); "
                  "zero-bubble schedule")
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(table([row]))
    text = console.export_text()
    assert_fits_80(text)
    words = set(text.replace("┃", " ").replace("│", " ").split())
    for header in ("model", "cluster", "grid best", "grid TFLOP/s", "autopar plan",
                   "autopar TFLOP/s", "ratio", "solve s", "why"):
        assert set(header.split()) <= words, f"header {header!r} was cut: {text}"
