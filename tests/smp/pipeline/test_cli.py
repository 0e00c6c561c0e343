"""`smp plan`: the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from smp.pipeline.cli import main

ROOT = Path(__file__).resolve().parents[3]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_for_1f1b(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--pp", "4", "--microbatches", "8", "--pipeline", "1f1b", "--json")
    data = json.loads(out)
    assert code == 0
    assert data["bubble_fraction"] == 0.375
    assert data["peak_in_flight"] == [4, 3, 2, 1]
    assert data["makespan"] == 33.0
    assert data["wall_share"] == pytest.approx(9 / 33)
    assert data["actions"]["3"][:4] == ["3F0", "3B0", "3F1", "3B1"]


def test_interleaved_pp3_prints_smp_v1_documented_order(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--pp", "3", "--microbatches", "8", "--pipeline", "interleaved")
    assert code == 0
    assert "rank 2: F0 B0 F1 B1 F2 B2" in out
    assert "rank 1: F0 F1 F2 B0 F3 B1" in out
    assert "rank 0: F0 F1 F2 F3 F4 B0 F5 B1" in out
    assert "bubble_fraction" in out and "peak_in_flight" in out


def test_files_chain_costs_and_lowered(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svg, trace = tmp_path / "p.svg", tmp_path / "p.json"
    code, out, _ = run(
        capsys, "--pp", "2", "--microbatches", "4", "--pipeline", "zb_h1", "--chain", "0,1,0",
        "--costs", "1,2,1", "--latency", "0.1", "--svg", str(svg), "--trace", str(trace), "--lowered",
    )
    assert code == 0
    assert svg.read_text().startswith("<svg") and json.loads(trace.read_text())["traceEvents"]
    assert "SEND_F" in out and f"wrote SVG to {svg}" in out


def test_errors_exit_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "--pp", "2", "--microbatches", "4", "--pipeline", "nope")
    assert code == 2 and "valid names: simple, interleaved, gpipe, 1f1b" in err
    code, _, err = run(capsys, "--pp", "2", "--microbatches", "4", "--costs", "fast")
    assert code == 2 and "expected 'F,B,W'" in err
    code, _, err = run(capsys, "--pp", "2")
    assert code == 2 and "--microbatches" in err


def test_console_script_runs_without_torch() -> None:
    script = Path(sys.executable).with_name("smp")
    if not script.exists():
        pytest.skip("the smp console script is not installed in this environment")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [str(script), "plan", "--pp", "4", "--microbatches", "8", "--pipeline", "1f1b", "--json"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["peak_in_flight"] == [4, 3, 2, 1]
