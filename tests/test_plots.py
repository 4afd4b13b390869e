"""`make plots` (scripts/plots.py): dvc.yaml's plots as a page that renders without network."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DVC = str(Path(sys.executable).parent / "dvc")


def plots_repo(tmp_path: Path) -> Path:
    """A git + DVC repository with two top-level plots over one TSV (like dvc.yaml's curves)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "curve.tsv").write_text(
        "step\tloss\treward\n" + "".join(f"{i}\t{1 / (i + 1):.3f}\t{i / 10}\n" for i in range(10))
    )
    (repo / "dvc.yaml").write_text(
        "plots:\n"
        "  - loss:\n      x: step\n      y: {curve.tsv: loss}\n"
        "  - reward:\n      x: step\n      y: {curve.tsv: reward}\n"
    )
    for cmd in (["git", "init", "-q"], [DVC, "init", "-q"]):
        subprocess.run(cmd, cwd=repo, check=True, capture_output=True)
    return repo


def run_plots(repo: Path, out: str) -> Path:
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts/plots.py"), "-o", out], cwd=repo, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return repo / out / "index.html"


def test_the_page_loads_no_script_from_the_network(tmp_path):
    """DVC's own page loads Vega from a CDN; ours inlines it: no <script src=...> at all, every plot's div there."""
    page = run_plots(plots_repo(tmp_path), "reports/plots").read_text()
    assert not re.search(r"<script[^>]*\bsrc=", page), "a script is loaded from elsewhere"
    assert "cdn.jsdelivr" not in page
    assert "window.vegaEmbed" in page and page.count("vegaEmbed('#") == 2
    assert "{plot_divs}" not in page


def _rendered_marks(page: Path) -> int:
    """How many Vega views a headless Chromium with all network refused renders on `page`."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        pytest.skip("no chromium (CI installs it before the slow tests)")
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--proxy-server=http://127.0.0.1:9"]
    cmd += ["--virtual-time-budget=15000", "--dump-dom", page.as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    return len(re.findall(r'<svg[^>]*class="marks"', dom)) + len(re.findall(r'<canvas[^>]*class="marks"', dom))


@pytest.mark.slow
def test_the_page_renders_every_plot_offline_where_dvcs_renders_none(tmp_path):
    repo = plots_repo(tmp_path)
    ours = run_plots(repo, "ours")
    subprocess.run([DVC, "plots", "show", "-o", "theirs"], cwd=repo, check=True, capture_output=True)
    assert _rendered_marks(ours) == 2
    assert _rendered_marks(repo / "theirs/index.html") == 0  # the CDN page, offline: blank (why this exists)
