"""The HTML report: self-contained, escaped, and checked in a real headless browser (Debian chromium)."""

from __future__ import annotations

import copy
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from profile_analyzer import analyze, load
from profile_analyzer.cli import main as cli_main
from profile_analyzer.report.html import render_html
from profile_analyzer.synth import GroundTruth, write_profile

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0", "--hide-scrollbars"]
# chromium logs every console message of the page (errors, CSP violations, uncaught exceptions) like this
CONSOLE_LINE = re.compile(r":CONSOLE[:(]\d+\)?\]\s*(.*)")


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> GroundTruth:
    return write_profile(tmp_path_factory.mktemp("html-prof"), ranks=2, steps=2, layers=4, dbo=True,
                         exposed_layers=[1], seed=5)


@pytest.fixture(scope="module")
def report_dict(profile: GroundTruth) -> dict:
    return analyze(load(profile.root)).to_dict()


@pytest.fixture(scope="module")
def page(report_dict: dict) -> str:
    return render_html(report_dict)


def test_page_is_self_contained(page: str, report_dict: dict) -> None:
    assert page.startswith("<!DOCTYPE html>")
    assert "default-src 'none'" in page  # the browser may load nothing from anywhere
    lowered = page.lower()
    for forbidden in ("<script", "<link", "@import", "url(", "http://", "https://", "src="):
        assert forbidden not in lowered, forbidden
    # every window of the report's timeline is drawn, one lane per stream, one rectangle per task
    assert report_dict["timeline"], "the synthetic DBO profile with an exposed layer must have exposed windows"
    assert page.count('<svg class="timeline"') == len(report_dict["timeline"][:8])
    first = report_dict["timeline"][0]
    svg = page.split('<svg class="timeline"')[1].split("</svg>")[0]
    assert svg.count('<g class="lane"') == len(first["lanes"])
    n_tasks = sum(1 for lane in first["lanes"] for t in lane["tasks"]
                  if t["end_us"] >= first["start_us"] and t["start_us"] <= first["end_us"])
    assert svg.count('<rect class="task ') == n_tasks
    assert svg.count('<rect class="band"') == len(first["exposed"])
    # the tables: the step breakdown has one row per (rank, step)
    breakdown = page.split("<h2>Step breakdown")[1].split("</table>")[0]
    assert breakdown.count("<tr>") == len(report_dict["breakdown"]) + 1


def test_page_escapes_profile_strings(report_dict: dict) -> None:
    d = copy.deepcopy(report_dict)
    evil = "<script>alert(1)</script>"
    d["timeline"][0]["lanes"][0]["stream"] = evil
    d["verdict"] = evil
    d["source"]["path"] = evil
    html = render_html(d)
    assert evil not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_page_without_timeline_or_ranks_says_so(report_dict: dict) -> None:
    d = copy.deepcopy(report_dict)
    d["timeline"] = []
    d["exposed_communication"] = []
    html = render_html(d)
    assert '<svg class="timeline"' not in html
    assert "No exposed-communication windows" in html


def test_real_single_card_sample_page(msprof_sample: Path) -> None:
    """The real torch_npu sample (one card, no communication): no timeline, the missing-file warning shown."""
    d = analyze(load(msprof_sample / "single_card_ascend_pt")).to_dict()
    html = render_html(d)
    assert "No exposed-communication windows" in html
    assert html.count('class="warning"') == len(d["warnings"]) >= 1
    assert 'class="card alert"' not in html  # nothing exposed, nothing flagged
    assert "Stream 3" in html  # the sample's only Ascend Hardware stream, in the utilisation table


def test_cli_writes_html(profile: GroundTruth, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    assert cli_main(["report", str(profile.root), "--format", "html", "--output", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and '<svg class="timeline"' in text


# ---------------------------------------------------------------------------------------------------
# real browser


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed: run `make browser` (make test installs it) to run the HTML "
                    "report's browser test")
    return exe


def _run_chromium(exe: str, url: str, profile_dir: Path, *extra: str) -> tuple[str, list[str]]:
    """(stdout, console messages) of one headless chromium run."""
    proc = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}", *extra, url],
                          capture_output=True, text=True, timeout=120)
    console = [m.group(1) for m in map(CONSOLE_LINE.search, proc.stderr.splitlines()) if m]
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, console


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


@pytest.mark.browser
def test_page_renders_in_headless_chromium(page: str, report_dict: dict, tmp_path: Path) -> None:
    exe = _chromium()
    html = tmp_path / "report.html"
    html.write_text(page, encoding="utf-8")

    # the console check is real: it sees a CSP violation and an uncaught exception on a bad page
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><head><meta http-equiv=\"Content-Security-Policy\" content=\"default-src "
                   "'none'; script-src 'unsafe-inline'\"></head><body><img src=\"https://example.invalid/x.png\">"
                   "<script>undefinedFunction()</script></body></html>")
    _, bad_console = _run_chromium(exe, bad.as_uri(), tmp_path / "ud-bad", "--dump-dom")
    assert any("Content Security Policy" in m for m in bad_console), bad_console
    assert any("undefinedFunction" in m for m in bad_console), bad_console

    dom, console = _run_chromium(exe, html.as_uri(), tmp_path / "ud", "--dump-dom")
    assert console == [], console
    assert '<svg class="timeline"' in dom
    assert dom.count('<rect class="task ') > 10
    assert 'id="verdict"' in dom and report_dict["verdict"][:40] in dom
    assert "Step breakdown" in dom and "Stream utilisation" in dom and "Dual-batch overlap" in dom

    shot = tmp_path / "report.png"
    _, console = _run_chromium(exe, html.as_uri(), tmp_path / "ud-shot", f"--screenshot={shot}",
                               "--window-size=1400,2000")
    assert console == [], console
    assert _png_size(shot) == (1400, 2000)
    assert shot.stat().st_size > 50_000  # a rendered page with charts, not a blank canvas


# ---------------------------------------------------------------------------------------------------
# idle gaps (host-bound): drawn also when the profile has no communication


def _gap_svgs(html: str) -> tuple[str, str]:
    line = html.split('<svg class="gapline"')[1].split("</svg>")[0]
    bars = html.split('<svg class="gapbars"')[1].split("</svg>")[0]
    return line, bars


def test_single_card_host_bound_gaps_are_drawn(msprof_sample: Path) -> None:
    """The real single-card sample: no communication, 275 gaps, 99% host-bound. Each of the report's largest
    gaps is drawn on the step's time axis and as a ranked bar, split into its host-bound part and the rest."""
    from profile_analyzer.report.html import MAX_GAP_BARS, _gap_parts

    d = analyze(load(msprof_sample / "single_card_ascend_pt")).to_dict()
    largest = d["idle_gaps"][0]["largest"]
    assert len(largest) >= 10 and d["summary"]["communication_us"] == 0
    html = render_html(d)
    line, bars = _gap_svgs(html)
    pieces = [piece for g in largest for piece in _gap_parts(g)]
    assert line.count('<rect class="gap ') == len(pieces)
    assert line.count('<rect class="gap k-host"') == sum(1 for g in largest if (g["host_bound_us"] or 0) > 0)
    assert bars.count('<g class="gap-bar">') == min(len(largest), MAX_GAP_BARS)
    # the longest gap's bar, labelled with its duration and the kernels around it
    top = largest[0]
    assert f"{top['dur_us'] / 1e3:,.2f} ms" in bars or f"{top['dur_us']:,.1f} µs" in bars
    assert (top["before"] or "(start)")[:10] in bars
    assert "of 275 idle gaps" in html and "99% host-bound" in html
    # the empty communication tables say why they are empty
    assert html.count("the profile has no communication operators") >= 4
    assert "Nothing to show.</p>" not in html


def test_gap_parts_split_host_bound_first() -> None:
    from profile_analyzer.report.html import _gap_parts

    gap = {"start_us": 10.0, "end_us": 20.0, "dur_us": 10.0}
    assert [(a, b, c) for a, b, c, _ in _gap_parts({**gap, "host_bound_us": 4.0})] == [
        (10.0, 14.0, "k-host"), (14.0, 20.0, "k-wait")]
    assert [c for *_, c, _ in _gap_parts({**gap, "host_bound_us": 10.0})] == ["k-host"]
    assert [c for *_, c, _ in _gap_parts({**gap, "host_bound_us": 0.0})] == ["k-wait"]
    assert [c for *_, c, _ in _gap_parts({**gap, "host_bound_us": None})] == ["k-other"]
    assert _gap_parts({**gap, "host_bound_us": 25.0})[0][1] == 20.0  # clipped to the gap


def test_gap_geometry_follows_the_step_axis(report_dict: dict) -> None:
    """Synthetic DBO profile: gaps are placed by their start on the rank's step axis, inside the plot."""
    from profile_analyzer.report.html import LABEL_W, PLOT_W, idle_gap_models

    models = idle_gap_models(report_dict)
    assert models, "the synthetic profile has idle gaps on its compute streams"
    for model in models:
        xs = [r["x"] for lane in model["lanes"] for r in lane["rects"]]
        assert xs and all(LABEL_W - 0.01 <= x <= LABEL_W + PLOT_W + 0.01 for x in xs)
    rank0 = next(m for m in models if m["rank"] == 0)
    gaps = next(e for e in report_dict["idle_gaps"] if e["rank"] == 0)["largest"]
    first, last = min(gaps, key=lambda g: g["start_us"]), max(gaps, key=lambda g: g["start_us"])
    rect_xs = sorted(r["x"] for lane in rank0["lanes"] for r in lane["rects"])
    assert rect_xs[0] < rect_xs[-1] and first["start_us"] < last["start_us"]
