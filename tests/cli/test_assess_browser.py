"""The `kvtether assess` report in a real headless browser: it renders, and its plots are there.

Chromium comes from Debian's package (scripts/ensure-chromium.sh installs it with apt when missing, as root);
the test is skipped when no browser can be had."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from kvtether.cli.main import app
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]


def chromium() -> str:
    got = subprocess.run(["bash", str(ROOT / "scripts" / "ensure-chromium.sh")], capture_output=True, text=True,
                         timeout=900)
    if got.returncode != 0 or not got.stdout.strip():
        pytest.skip(f"no headless browser: {got.stderr.strip()[-200:]}")
    return got.stdout.strip().splitlines()[-1]


def test_report_renders_with_its_plots(tmp_path: Path) -> None:
    browser = chromium()
    report = tmp_path / "report.html"
    result = CliRunner().invoke(app, ["assess", str(ROOT / "examples" / "sessions" / "agent-small.jsonl"),
                                      "--limit", "2", "--options", "no-pull,colocated",
                                      "--report", str(report), "--json", "-q"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["report"] == str(report)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([browser, *flags, "--dump-dom", report.as_uri()], capture_output=True, text=True,
                         timeout=120)
    assert dom.returncode == 0, dom.stderr[-500:]
    html = dom.stdout
    # One figure per plot, each an inline SVG the browser parsed into the DOM (no script, no network).
    for figure in ("plot-prefix-share", "plot-breakeven", "plot-gaps", "plot-held", "plot-ttft"):
        start = html.index(f'id="{figure}"')
        assert "<svg" in html[start:start + 400], figure
    assert html.count("<svg") >= 5 and "<script" not in html
    assert "verdict" in html and "TTFT p95" in html
    shot = tmp_path / "report.png"
    png = subprocess.run([browser, *flags, "--hide-scrollbars", "--window-size=1200,3000",
                          f"--screenshot={shot}", report.as_uri()], capture_output=True, text=True, timeout=120)
    assert png.returncode == 0 and shot.exists(), png.stderr[-500:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000  # a blank page compresses to a few kB
    keep = ROOT / "build" / "assess-report.png"
    keep.parent.mkdir(exist_ok=True)
    shutil.copy(shot, keep)  # for a person to look at
