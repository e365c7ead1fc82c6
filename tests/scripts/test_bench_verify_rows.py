"""scripts/bench/verify_rows.py: one whole run on the bundled target (seconds), its table and the queries it reports."""

from __future__ import annotations

from pathlib import Path

from headstart.scripts.bench import verify_rows as bench_verify_rows

DEMO_TARGET = Path(__file__).resolve().parents[2] / "assets" / "demo-target"


def test_the_table_gives_each_chain_the_queries_its_verify_runs(capsys):
    bench_verify_rows.main(["--target", str(DEMO_TARGET), "--context", "24", "--max-queries", "5", "--repeats", "2"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.strip("|").split("|") for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5]
    assert [int(r[3]) for r in rows] == [1, 4, 4, 4, 8]  # on the CPU: rounded up to a multiple of 4 beyond one
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
    assert rows[0][4].strip() == "1.00x"
