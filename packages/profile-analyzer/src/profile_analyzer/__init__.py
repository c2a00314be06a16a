"""Where communication is not overlapped: msprof, torch_npu and Kineto profile analysis.

Public API::

    from profile_analyzer import load, analyze
    timeline = load("prof_dir")          # any supported format, see loaders.detect
    report = analyze(timeline, rank=None, step=None)
    report.to_dict()                     # the versioned JSON schema (report/json_schema.py)
    timeline, report = load_and_analyze("prof_dir", jobs=2)   # each rank loaded and analysed in a worker
    _, report = load_and_analyze("prof_dir", keep_timeline=False)  # one rank's events held at a time
"""

from __future__ import annotations

from profile_analyzer._version import __version__
from profile_analyzer.api import analyze, load_and_analyze
from profile_analyzer.errors import ProfileError
from profile_analyzer.loaders import detect, load
from profile_analyzer.report.model import Report
from profile_analyzer.timeline import Kind, RankTimeline, Steps, Stream, Timeline

__all__ = ["Kind", "ProfileError", "RankTimeline", "Report", "Steps", "Stream", "Timeline", "analyze", "detect", "load",
           "load_and_analyze",
           "__version__"]
