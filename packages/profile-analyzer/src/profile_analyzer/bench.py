"""Benchmark of profile-analyzer against msprof-analyze on one large generated profile (``make bench``).

1. A synthetic 8-rank torch_npu profile of at least 1 GiB of trace_view.json in all (``profile_analyzer.synth``,
   a stand-in for a real NPU run) is generated once and cached under ``<repo>/.cache/``.
2. ``profile-analyzer report <profile> --format json [--jobs N]`` runs in a child process: wall time, events per
   second (JSON events in the input / wall time) and peak memory: the largest sum over the child and its worker
   processes of their proportional set sizes (PSS: a page shared by n processes counts 1/n in each, so pages
   the forked workers share with the parent count once), the same sum of resident sizes (RSS, which counts
   every shared page in every process: an upper bound), both sampled from /proc, and the largest single
   process (``ru_maxrss``). Where msprof-analyze is measured, our run is repeated (once before it, twice after):
   the median time counts and the largest memory, as on the Kineto side.
3. The same files go through msprof-analyze (PyPI ``msprof-analyze``, installed by this script into its own
   virtualenv under ``.cache/``): its ``compare`` command is the code path that parses trace_view.json (its
   NPU parser reads every event, the Overlap Analysis track and the Communication planes). ``compare`` takes
   two profiles, so the 8 ranks run as 4 pairs (0 vs 1, 2 vs 3, ...): every file is parsed exactly once.
4. HTA (PyPI ``HolisticTraceAnalysis``, in its own virtualenv under ``.cache/``: ``make hta-env``, or this script
   installs it the same way): a single-rank Kineto trace of ~370 MB made by repeating one of HTA's own public
   test traces (``tests/data/hta-kineto/single-rank/nccl_data.json.gz``, MIT) end to end in time
   (:func:`repeat_kineto_trace`), cached under ``.cache/``. ``TraceAnalysis(trace_dir).get_comm_comp_overlap()``
   against ``profile-analyzer report --jobs 1``; HTA's figure and our ``whole_trace_overlap_pct`` must agree to
   0.01.
5. A table on the terminal, and ``OUT/profile_analyzer.json``.

Before the measurements our command runs once on two small profiles (:func:`warm_bytecode`) with bytecode writing
allowed, so that it is timed importing compiled modules, as the other tools (pip-installed venvs) are.

Targets (issue 12): one process (``--jobs 1``) at least 20x msprof-analyze and at least 20x HTA, measured side by
side in one run; peak memory under 1.5x the largest file.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from profile_analyzer.synth import GROUND_TRUTH_FILE, GroundTruth, write_profile

MSPROF_ANALYZE_VERSION = "26.2.0"
HTA_VERSION = "0.5.0"
GIB = 1 << 30
BENCH_PROFILE: dict = dict(pattern="a3", dbo=True, layers=61, exposed_layers=(3, 30), seed=2026)
SPEED_TARGET = 20.0
MEMORY_TARGET = 1.5
HTA_SOURCE_TRACE = Path(__file__).resolve().parents[2] / "tests" / "data" / "hta-kineto" / "single-rank" / "nccl_data.json.gz"
HTA_TRACE_BYTES = 370_000_000  # the size of the repeated trace (the earlier HTA measurement's 371 MB)
# small profiles of each format the bench measures, run once before the measurements (see warm_bytecode)
WARM_UP_PROFILES = (Path(__file__).resolve().parents[2] / "tests" / "data" / "msprof-sample", HTA_SOURCE_TRACE)


@dataclass
class Run:
    """One measured child process.

    ``peak_rss_bytes`` is the kernel's high-water mark of the largest single process of the tree (the child's
    ``ru_maxrss`` from ``wait4``, which covers the children it waited for); ``tree_peak_rss_bytes`` is the
    largest *sum* of the resident sizes of the child and all its descendants, sampled from /proc every 20 ms
    (0 where /proc is missing). ``tree_peak_pss_bytes`` is the largest sum of their proportional set sizes
    (``/proc/PID/smaps_rollup``, sampled every 60 ms): what the machine actually holds for the tree, shared pages counted once;
    0 where the kernel does not provide it.
    """

    command: list[str]
    wall_s: float
    peak_rss_bytes: int
    returncode: int
    output_tail: str
    tree_peak_rss_bytes: int = 0
    tree_peak_pss_bytes: int = 0

    @property
    def tree_peak_bytes(self) -> int:
        """The memory figure the target is judged on: PSS where the kernel gives it, else the RSS sum."""
        return self.tree_peak_pss_bytes or self.tree_peak_rss_bytes


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except (OSError, ValueError):
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants right now."""
    return _rss_bytes(pid) + sum(_rss_bytes(c) for c in _descendants(pid))


def tree_memory_bytes(pid: int) -> tuple[int, int]:
    """(RSS sum, PSS sum) of ``pid`` and all its descendants right now."""
    pids = [pid, *_descendants(pid)]
    return sum(map(_rss_bytes, pids)), sum(map(_pss_bytes, pids))


def repo_root(start: Path | None = None) -> Path:
    """The checkout this runs in (the folder with the Makefile and .git), else the current folder."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / ".git").exists() and (d / "Makefile").exists():
            return d
    return here


def measure(cmd: list[str], timeout_s: float, log: Path, env: dict[str, str] | None = None,
            own_group: bool = False) -> Run:
    """Run ``cmd``; wall time and peak RSS of the child (and the children it waited for), bounded by timeout.
    ``own_group``: the child leads a process group of its own, and past the timeout the whole group is killed (its
    worker processes too)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=own_group)
        deadline = t0 + timeout_s
        tree_peak = pss_peak = 0
        tick = 0
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            # RSS (statm, cheap) every 20 ms; PSS (smaps_rollup walks every mapping) every 60 ms, so the sampling
            # takes little CPU from the command it measures on a small machine
            if tick % 3 == 0:
                rss, pss = tree_memory_bytes(proc.pid)
                pss_peak = max(pss_peak, pss)
            else:
                rss = tree_rss_bytes(proc.pid)
            tree_peak = max(tree_peak, rss)
            tick += 1
            if time.perf_counter() > deadline:
                if own_group:
                    try:
                        os.killpg(proc.pid, 9)
                    except OSError:
                        proc.kill()
                else:
                    proc.kill()
                pid, status, ru = os.wait4(proc.pid, 0)
                proc.returncode = -9
                raise TimeoutError(f"{' '.join(cmd[:4])} ... did not finish within {timeout_s:.0f} s (log: {log})")
            time.sleep(0.02)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    tail = log.read_bytes()[-4000:].decode("utf-8", "replace")
    return Run(cmd, wall, ru.ru_maxrss * 1024, proc.returncode, tail, max(tree_peak, ru.ru_maxrss * 1024), pss_peak)


# --------------------------------------------------------------------------------------------------
# the input


def _probe_bytes_per_step(params: dict) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        t1 = write_profile(tmp, ranks=1, steps=1, **params)
        t2 = write_profile(Path(tmp) / "b", ranks=1, steps=2, **params)
        return max(1, t2.total_bytes - t1.total_bytes)


def ensure_profile(cache: Path, ranks: int, target_bytes: int, log=print, layers: int | None = None) -> GroundTruth:
    """The cached bench profile (regenerated when missing or made with other parameters)."""
    params = {**BENCH_PROFILE, **({"layers": layers} if layers else {})}
    params["exposed_layers"] = tuple(i for i in params["exposed_layers"] if i < params["layers"])
    key = f"synth-r{ranks}-{target_bytes}-{params['pattern']}-l{params['layers']}-s{params['seed']}"
    root = cache / "profile-analyzer-bench" / key
    if (root / GROUND_TRUTH_FILE).is_file():
        truth = GroundTruth.load(root)
        if all(d.is_dir() for d in truth.profile_dirs.values()) and truth.total_bytes >= target_bytes:
            log(f"bench profile: cached at {root} ({truth.total_bytes / 1e6:.0f} MB)")
            return truth
    if root.exists():
        shutil.rmtree(root)
    per_step = _probe_bytes_per_step(params)
    steps = max(1, math.ceil(target_bytes / (ranks * per_step))) + 1
    log(f"bench profile: generating {ranks} ranks x {steps} steps (~{per_step * steps * ranks / 1e6:.0f} MB) "
        f"under {root} ...")
    t0 = time.perf_counter()
    truth = write_profile(root, ranks=ranks, steps=steps, workers=min(ranks, os.cpu_count() or 1), **params)
    log(f"bench profile: {truth.total_bytes / 1e6:.0f} MB, {truth.total_events} events in "
        f"{time.perf_counter() - t0:.1f} s")
    return truth


def trace_files(truth: GroundTruth) -> dict[int, Path]:
    return {r: d / "ASCEND_PROFILER_OUTPUT" / "trace_view.json" for r, d in sorted(truth.profile_dirs.items())}


# --------------------------------------------------------------------------------------------------
# the two tools


def run_ours(truth: GroundTruth, work: Path, timeout_s: float, cprofile: bool = False, jobs: int = 1) -> tuple[Run, dict]:
    out = work / "report.json"
    cmd = [sys.executable, "-m", "profile_analyzer", "report", str(truth.root), "--format", "json", "--output",
           str(out), "--jobs", str(jobs)]  # always explicit: the CLI's default depends on the machine
    if cprofile:  # where the time goes: the top of a cProfile of the same command
        cmd = [sys.executable, "-m", "cProfile", "-o", str(work / "ours.pstats"), *cmd[1:]]
    run = measure(cmd, timeout_s, work / "ours.log")
    if run.returncode != 0:
        raise RuntimeError(f"profile-analyzer report failed (exit {run.returncode}): {run.output_tail[-800:]}")
    return run, json.loads(out.read_text())


PHASES_SCRIPT = """
import json, resource, sys, time
def hwm():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
import profile_analyzer
from profile_analyzer.report.render import render
t1 = time.perf_counter(); m1 = hwm()
tl = profile_analyzer.load(sys.argv[1])
t2 = time.perf_counter(); m2 = hwm()
d = profile_analyzer.analyze(tl).to_dict()
t3 = time.perf_counter(); m3 = hwm()
text = render(d, "json")
t4 = time.perf_counter(); m4 = hwm()
# How much of the load is msgspec's decode of the traces, and how much of that its JSON parse alone: every
# trace_view.json decoded whole into the production structs, then into structs that keep no field (the parse and
# one object per event). After the phases above, so their memory marks are not touched.
import msgspec
from pathlib import Path
from profile_analyzer.loaders._slicer import _list_decoder
class _Nothing(msgspec.Struct, gc=False):
    pass
_floor = msgspec.json.Decoder(list[_Nothing])
files = sorted(Path(sys.argv[1]).rglob("trace_view.json"))
dec = floor = 0.0
for f in files:
    data = f.read_bytes()
    a = time.perf_counter(); x = _list_decoder.decode(data); b = time.perf_counter(); del x
    y = _floor.decode(data); c = time.perf_counter(); del y, data
    dec += b - a; floor += c - b
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "analyze_s": t3 - t2, "render_json_s": t4 - t3,
                  "rss_hwm_after_import": m1, "rss_hwm_after_load": m2, "rss_hwm_after_analyze": m3,
                  "rss_hwm_after_render": m4, "report_json_bytes": len(text.encode()),
                  "timeline_tasks": tl.n_events, "decode_whole_files_s": dec, "parse_floor_s": floor,
                  "trace_files": len(files)}))
"""


def run_phases(truth: GroundTruth, work: Path, timeout_s: float) -> dict:
    """Where our time and memory go: import, load, analyze, render (one child process, in-process timers)."""
    run = measure([sys.executable, "-c", PHASES_SCRIPT, str(truth.root)], timeout_s, work / "phases.log")
    if run.returncode != 0:
        raise RuntimeError(f"phase timing failed (exit {run.returncode}): {run.output_tail[-800:]}")
    out = json.loads(run.output_tail.strip().splitlines()[-1])
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


def ensure_msprof_analyze(cache: Path, log=print) -> Path:
    """msprof-analyze in its own virtualenv under .cache (its pandas/numpy pins stay out of ours)."""
    venv = cache / f"msprof-analyze-{MSPROF_ANALYZE_VERSION}-venv"
    exe = venv / "bin" / "msprof-analyze"
    if exe.exists():
        return exe
    log(f"msprof-analyze: installing {MSPROF_ANALYZE_VERSION} into {venv} ...")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                          f"msprof-analyze=={MSPROF_ANALYZE_VERSION}"], capture_output=True, text=True, timeout=1200)
    if pip.returncode != 0 or not exe.exists():
        shutil.rmtree(venv, ignore_errors=True)
        raise RuntimeError(f"pip install msprof-analyze=={MSPROF_ANALYZE_VERSION} failed: {pip.stderr[-800:]}")
    return exe


def run_msprof_compare(exe: Path, truth: GroundTruth, work: Path, timeout_s: float) -> list[Run]:
    """``msprof-analyze compare -d rank(2i) -bp rank(2i+1)`` for every pair: each file parsed once."""
    ranks = sorted(truth.profile_dirs)
    pairs = [(ranks[i], ranks[i + 1]) for i in range(0, len(ranks) - 1, 2)]
    if len(ranks) % 2:
        pairs.append((ranks[-1], ranks[0]))
    runs = []
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for a, b in pairs:
        out = work / f"msprof-compare-{a}-{b}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        cmd = [str(exe), "compare", "-d", str(truth.profile_dirs[a]), "-bp", str(truth.profile_dirs[b]), "-o",
               str(out)]
        run = measure(cmd, timeout_s, work / f"msprof-compare-{a}-{b}.log", env=env)
        if run.returncode != 0 or not list(out.glob("performance_comparison_result_*.xlsx")):
            raise RuntimeError(f"msprof-analyze compare {a} vs {b} produced no result: {run.output_tail[-800:]}")
        runs.append(run)
    return runs


# --------------------------------------------------------------------------------------------------
# HTA on a large Kineto trace


def repeat_kineto_trace(source: Path, dest: Path, repeats: int) -> dict:
    """Write ``repeats`` copies of the Kineto trace ``source`` end to end in time into ``dest`` (plain JSON).

    Copy ``k`` is shifted by ``k`` times the trace's span (whole µs, plus a 1 ms gap, so every digit after the point
    stays as the profiler wrote it: the numbers are decoded and written as decimals, never through float);
    ``ProfilerStep#N`` becomes ``#N + k * steps``; ``correlation``, ``External id`` and flow ids are offset so that
    each launch still links to its own kernel. Metadata (``ph`` M) events are written once. The file-level keys
    (``distributedInfo``, ``deviceProperties`` ...) are kept. Returns what was written (events, bytes, steps)."""
    import decimal

    import msgspec

    raw = gzip.decompress(source.read_bytes()) if source.suffix == ".gz" else source.read_bytes()
    doc = msgspec.json.Decoder(float_hook=decimal.Decimal).decode(raw)
    events = doc.pop("traceEvents")
    meta = [e for e in events if e.get("ph") == "M"]
    body = [e for e in events if e.get("ph") != "M"]
    stamps = [(e["ts"], e.get("dur") or 0) for e in body if "ts" in e]
    lo = min(t for t, _ in stamps)
    hi = max(t + d for t, d in stamps)
    shift_us = int(hi - lo) + 1 + 1000
    step_re = re.compile(r"^ProfilerStep#(\d+)$")
    step_ids = sorted({int(m.group(1)) for e in body if (m := step_re.match(str(e.get("name", ""))))})
    n_steps = (step_ids[-1] - step_ids[0] + 1) if step_ids else 0

    def largest(key: str) -> int:
        vals = [e.get("args", {}).get(key) for e in body] + ([e.get("id") for e in body] if key == "id" else [])
        return max([v for v in vals if isinstance(v, int)], default=0) + 1

    id_step = max(largest("correlation"), largest("External id"), largest("id"))
    enc = msgspec.json.Encoder(decimal_format="number")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    n = len(meta)
    with open(tmp, "wb") as f:
        head = enc.encode(doc)
        f.write(head[:-1] + (b', "traceEvents": [' if len(head) > 2 else b'{"traceEvents": ['))
        sep = b""
        if meta:
            f.write(b",\n".join(enc.encode(e) for e in meta))
            sep = b",\n"
        for k in range(repeats):
            out = []
            for e in body:
                c = dict(e)
                if "ts" in c:
                    c["ts"] = c["ts"] + k * shift_us
                if k and n_steps and (m := step_re.match(str(c.get("name", "")))):
                    c["name"] = f"ProfilerStep#{int(m.group(1)) + k * n_steps}"
                if k and isinstance(c.get("id"), int):
                    c["id"] = c["id"] + k * id_step
                args = c.get("args")
                if k and isinstance(args, dict) and any(isinstance(args.get(a), int) for a in ("correlation", "External id")):
                    c["args"] = {**args, **{a: args[a] + k * id_step for a in ("correlation", "External id")
                                            if isinstance(args.get(a), int)}}
                out.append(enc.encode(c))
            if out:
                f.write(sep + b",\n".join(out))
                sep = b",\n"
            n += len(out)
        f.write(b"]}\n")
    os.replace(tmp, dest)
    return {"events": n, "bytes": dest.stat().st_size, "repeats": repeats, "profiler_steps": n_steps * repeats,
            "source": source.name}


def ensure_hta_trace(cache: Path, target_bytes: int = HTA_TRACE_BYTES, source: Path = HTA_SOURCE_TRACE,
                     log=print) -> tuple[Path, dict]:
    """The cached repeated Kineto trace (made once; regenerated when missing or made with other parameters)."""
    if not source.is_file():
        raise RuntimeError(f"HTA's test trace {source} is missing (an installed, not a checked-out, profile-analyzer?)")
    with tempfile.TemporaryDirectory() as tmp:  # the bytes one more copy adds
        one = repeat_kineto_trace(source, Path(tmp) / "2.json", 2)["bytes"] - repeat_kineto_trace(
            source, Path(tmp) / "1.json", 1)["bytes"]
    repeats = max(1, round(target_bytes / max(one, 1)))
    name = source.name.removesuffix(".gz").removesuffix(".json")
    root = cache / "profile-analyzer-bench" / f"hta-{name}-x{repeats}"
    # the trace alone in its folder: HTA reads every .json of the folder it is given as a rank
    trace, info_file = root / "trace" / f"{name}-x{repeats}.json", root / "made.json"
    if trace.is_file() and info_file.is_file():
        info = json.loads(info_file.read_text())
        if info.get("bytes") == trace.stat().st_size:
            log(f"HTA bench trace: cached at {trace} ({info['bytes'] / 1e6:.0f} MB)")
            return trace, info
    log(f"HTA bench trace: writing {repeats} copies of {source.name} to {trace} ...")
    t0 = time.perf_counter()
    info = repeat_kineto_trace(source, trace, repeats)
    info_file.write_text(json.dumps(info))
    log(f"HTA bench trace: {info['bytes'] / 1e6:.0f} MB, {info['events']:,} events in {time.perf_counter() - t0:.1f} s")
    return trace, info


def ensure_hta(cache: Path, log=print) -> Path:
    """HTA in its own virtualenv under .cache (``make hta-env`` makes the same one): its python."""
    venv = cache / f"hta-{HTA_VERSION}-venv"
    py, stamp = venv / "bin" / "python", venv / ".setup-stamp"
    if stamp.exists() and py.exists():
        return py
    log(f"HTA: installing HolisticTraceAnalysis=={HTA_VERSION} into {venv} ...")
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", f"HolisticTraceAnalysis=={HTA_VERSION}"],
                         capture_output=True, text=True, timeout=1800)
    ok = pip.returncode == 0 and subprocess.run([str(py), "-c", "import hta.trace_analysis"],
                                                capture_output=True, timeout=300).returncode == 0
    if not ok:
        raise RuntimeError(f"pip install HolisticTraceAnalysis=={HTA_VERSION} failed: {pip.stderr[-800:]}")
    stamp.touch()
    return py


HTA_SCRIPT = """
import json, sys
from hta.trace_analysis import TraceAnalysis
df = TraceAnalysis(trace_dir=sys.argv[1]).get_comm_comp_overlap(visualize=False)
print("HTA_RESULT " + json.dumps(json.loads(df.to_json(orient="records"))))
"""


def run_hta(python: Path, trace: Path, work: Path, timeout_s: float) -> tuple[Run, list[dict]]:
    """HTA's ``get_comm_comp_overlap`` on the folder that holds ``trace`` (HTA reads a folder of rank traces)."""
    run = measure([str(python), "-c", HTA_SCRIPT, str(trace.parent)], timeout_s, work / "hta.log",
                  env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = [ln for ln in run.output_tail.splitlines() if ln.startswith("HTA_RESULT ")]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"HTA get_comm_comp_overlap failed (exit {run.returncode}): {run.output_tail[-800:]}")
    return run, json.loads(lines[-1].split(" ", 1)[1])


def run_ours_file(trace: Path, work: Path, timeout_s: float) -> tuple[Run, dict]:
    """``profile-analyzer report TRACE --format json --jobs 1``: the one-process run on a single-rank trace."""
    out = work / "report-kineto.json"
    cmd = [sys.executable, "-m", "profile_analyzer", "report", str(trace), "--format", "json", "--output", str(out),
           "--jobs", "1"]
    run = measure(cmd, timeout_s, work / "ours-kineto.log")
    if run.returncode != 0:
        raise RuntimeError(f"profile-analyzer report failed (exit {run.returncode}): {run.output_tail[-800:]}")
    return run, json.loads(out.read_text())


def run_hta_comparison(cache: Path, work: Path, timeout_s: float, log=print, target_bytes: int = HTA_TRACE_BYTES,
                       with_hta: bool = True, ours_runs: int = 3) -> dict:
    """Ours and HTA on the repeated Kineto trace in this run; their figures compared. Our run takes seconds, so a
    burst of other work on the machine during it would swing the ratio: it runs ``ours_runs`` times, spread around
    HTA's one long run (the first before it, the others after), and the median counts."""
    trace, info = ensure_hta_trace(cache, target_bytes, log=log)
    size = trace.stat().st_size

    def ours_once() -> tuple[Run, dict]:
        log("profile-analyzer report (Kineto trace, --jobs 1): running ...")
        return run_ours_file(trace, work, timeout_s)

    runs = [ours_once()]
    out: dict = {"input": {"trace": str(trace), "bytes": size, **info}}

    def finish() -> None:
        ours, report = runs[0]
        out["ours"] = {"jobs": 1, "command": " ".join(ours.command),
                       "whole_trace_overlap_pct": report.get("summary", {}).get("whole_trace_overlap_pct"),
                       "same_report_every_run": all(r == report for _, r in runs)}
        _median_of(out["ours"], [r for r, _ in runs], None, None, size)

    if not with_hta:
        runs += [ours_once() for _ in range(ours_runs - 1)]
        finish()
        return out
    python = ensure_hta(cache, log)
    log(f"HTA {HTA_VERSION} get_comm_comp_overlap: running ...")
    run, rows = run_hta(python, trace, work, timeout_s)
    runs += [ours_once() for _ in range(ours_runs - 1)]
    finish()
    ours = out["ours"]
    hta_pct = rows[0]["comp_comm_overlap_pctg"] if len(rows) == 1 else None
    ours_pct = out["ours"]["whole_trace_overlap_pct"]
    out["hta"] = {"version": HTA_VERSION, "wall_s": round(run.wall_s, 3), "tree_peak_rss_bytes": run.tree_peak_rss_bytes,
                  "command": f"TraceAnalysis(trace_dir=DIR).get_comm_comp_overlap(visualize=False)  ({python})",
                  "rows": rows, "comp_comm_overlap_pctg": hta_pct}
    out["figures_agree"] = (hta_pct is not None and ours_pct is not None and abs(hta_pct - ours_pct) <= 0.01)
    out["speed_ratio"] = round(run.wall_s / ours["wall_s"], 2)
    out["meets_speed_target"] = out["speed_ratio"] >= SPEED_TARGET
    # HTA's peak RSS over ours (our process tree's peak RSS, the same measure on both sides)
    if ours.get("tree_peak_rss_bytes"):
        out["memory_ratio"] = round(run.tree_peak_rss_bytes / ours["tree_peak_rss_bytes"], 2)
    return out


# --------------------------------------------------------------------------------------------------


def _tree_memory(run: Run, largest: int) -> dict[str, float]:
    """The process tree's peak memory fields of a result row, and their ratio to the largest input file."""
    return {"tree_peak_rss_bytes": run.tree_peak_rss_bytes,
            "peak_rss_vs_largest_file": round(run.tree_peak_rss_bytes / largest, 3),
            "tree_peak_pss_bytes": run.tree_peak_pss_bytes,
            "peak_memory_vs_largest_file": round(run.tree_peak_bytes / largest, 3)}


def warm_bytecode(work: Path, log=print) -> bool:
    """Run ``profile-analyzer report`` once on each of :data:`WARM_UP_PROFILES` with bytecode writing allowed, so
    that the measured runs import our modules (and click's, msgspec's) from ``.pyc`` as an installed package does
    (``pip install`` compiles them; a uv workspace venv and ``PYTHONDONTWRITEBYTECODE=1`` leave every run compiling
    them from source, about 0.3 s of a 2 s run). The other tools' venvs are pip-installed, so compiled. True when
    every warm-up ran."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    ok = True
    for i, profile in enumerate(p for p in WARM_UP_PROFILES if p.exists()):
        cmd = [sys.executable, "-m", "profile_analyzer", "report", str(profile), "--format", "json", "--output",
               str(work / f"warm-up-{i}.json"), "--jobs", "1"]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, timeout=600)
        except (OSError, subprocess.SubprocessError):
            ok = False
            continue
        ok = ok and done.returncode == 0
    if not ok:
        log("bench: a warm-up run (bytecode) failed; the measured runs may compile modules from source")
    return ok


def run_bench(out_dir: Path, *, cache: Path, ranks: int = 8, target_bytes: int = GIB, with_msprof: bool = True,
              timeout_s: float = 3600, cprofile: bool = False, phases: bool = False, log=print,
              layers: int | None = None, jobs: int = 1, with_hta: bool = True, hta_trace_bytes: int = HTA_TRACE_BYTES,
              kineto: bool = True) -> dict:
    """Every measurement of this module; ``kineto=False`` leaves the Kineto/HTA part out, ``with_hta=False`` runs only
    our side of it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    load_start = round(os.getloadavg()[0], 2)  # the machine may be shared: how busy it was, with the figures
    truth = ensure_profile(cache, ranks, target_bytes, log, layers=layers)
    files = trace_files(truth)
    sizes = {r: f.stat().st_size for r, f in files.items()}
    total_bytes, largest = sum(sizes.values()), max(sizes.values())
    work = out_dir / "profile_analyzer_work"
    work.mkdir(parents=True, exist_ok=True)
    warm_ok = warm_bytecode(work, log)
    log("profile-analyzer report: running ...")
    ours, report = run_ours(truth, work, timeout_s, jobs=jobs)
    result: dict = {
        "input": {"ranks": len(files), "trace_view_bytes": total_bytes, "largest_file_bytes": largest,
                  "events": truth.total_events, "profile": str(truth.root), "generator_params": truth.params},
        "ours": {"wall_s": round(ours.wall_s, 3), "events_per_s": round(truth.total_events / ours.wall_s),
                 "mb_per_s": round(total_bytes / 1e6 / ours.wall_s, 1), "jobs": jobs,
                 "peak_rss_bytes": ours.peak_rss_bytes, **_tree_memory(ours, largest),
                 "command": " ".join(ours.command)},
        "targets": {"speed_ratio_min": SPEED_TARGET, "peak_memory_vs_largest_file_max": MEMORY_TARGET,
                    "memory_measure": "sum of PSS over the process tree" if ours.tree_peak_pss_bytes
                    else "sum of RSS over the process tree"},
    }
    if jobs > 1:  # parallel loading trades memory for time: measure the one-process run as well
        log("profile-analyzer report --jobs 1: running ...")
        seq, _ = run_ours(truth, work, timeout_s, jobs=1)
        result["ours_jobs1"] = {"wall_s": round(seq.wall_s, 3), "events_per_s": round(truth.total_events / seq.wall_s),
                                **_tree_memory(seq, largest)}
    # the analysis itself must be right on the bench input, or the speed means nothing
    summary = report.get("summary", {})
    gt_comp = sum(r["totals"]["computing_us"] for r in truth.ranks.values())
    gt_exposed = sum(r["totals"]["communication_not_overlapped_us"] for r in truth.ranks.values())
    result["ours"]["check_computing_us"] = {"report": summary.get("computing_us"), "ground_truth": round(gt_comp, 3)}
    result["ours"]["check_not_overlapped_us"] = {"report": summary.get("communication_not_overlapped_us"),
                                                 "ground_truth": round(gt_exposed, 3)}
    tol = 1.0 * sum(len(r["steps"]) for r in truth.ranks.values())  # 1 µs per rank-step
    result["ours"]["matches_ground_truth"] = (
        abs((summary.get("computing_us") or 0) - gt_comp) <= tol
        and abs((summary.get("communication_not_overlapped_us") or 0) - gt_exposed) <= tol)
    if cprofile:
        prof_work = work / "cprofile"
        prof_work.mkdir(exist_ok=True)
        run_ours(truth, prof_work, timeout_s, cprofile=True)
        import pstats

        with open(out_dir / "profile_analyzer_cprofile.txt", "w") as f:
            pstats.Stats(str(prof_work / "ours.pstats"), stream=f).sort_stats("cumulative").print_stats(40)
        result["ours"]["cprofile"] = str(out_dir / "profile_analyzer_cprofile.txt")
    if phases:
        log("profile-analyzer phases: running ...")
        result["ours_phases"] = run_phases(truth, work, timeout_s)
    if with_msprof:
        exe = ensure_msprof_analyze(cache, log)
        log(f"msprof-analyze compare: {math.ceil(len(files) / 2)} pairs ...")
        runs = run_msprof_compare(exe, truth, work, timeout_s)
        m_wall = sum(r.wall_s for r in runs)
        m_rss = max(r.tree_peak_rss_bytes for r in runs)
        result["msprof_analyze"] = {
            "version": MSPROF_ANALYZE_VERSION, "command": "msprof-analyze compare -d RANK_A -bp RANK_B (per pair)",
            "wall_s": round(m_wall, 3), "peak_rss_bytes": m_rss,
            "runs": [{"command": " ".join(r.command), "wall_s": round(r.wall_s, 3),
                      "peak_rss_bytes": r.peak_rss_bytes, "tree_peak_rss_bytes": r.tree_peak_rss_bytes}
                     for r in runs],
        }
        # Ours takes seconds, msprof-analyze minutes: a burst of other work during our one run would swing the ratio.
        # As on the Kineto side, ours runs OURS_RUNS times (the first before msprof-analyze, the others after it) and
        # the median counts; memory is the largest of the runs.
        log(f"profile-analyzer report: {OURS_RUNS - 1} more runs ...")
        ours = _median_of(result["ours"], [ours, *(run_ours(truth, work, timeout_s, jobs=jobs)[0]
                                                   for _ in range(OURS_RUNS - 1))], truth.total_events, total_bytes, largest)
        if "ours_jobs1" in result:
            _median_of(result["ours_jobs1"], [seq, *(run_ours(truth, work, timeout_s, jobs=1)[0]
                                                     for _ in range(OURS_RUNS - 1))], truth.total_events, None, largest)
        result["speed_ratio"] = round(m_wall / result["ours"]["wall_s"], 2)
        if "ours_jobs1" in result:
            result["speed_ratio_jobs1"] = round(m_wall / result["ours_jobs1"]["wall_s"], 2)
        result["memory_ratio_msprof_over_ours"] = round(m_rss / ours.tree_peak_rss_bytes, 2)
        result["meets_speed_target"] = result["speed_ratio"] >= SPEED_TARGET
    if "speed_ratio_jobs1" in result:
        result["meets_speed_target_jobs1"] = result["speed_ratio_jobs1"] >= SPEED_TARGET
    elif "speed_ratio" in result and jobs == 1:
        result["meets_speed_target_jobs1"] = result["meets_speed_target"]
    # the memory target is about one process (--jobs 1): workers each hold a rank of their own
    one_process = result.get("ours_jobs1", result["ours"])
    result["meets_memory_target"] = one_process["peak_memory_vs_largest_file"] < MEMORY_TARGET
    result["targets"]["memory_target_run"] = "--jobs 1"
    if kineto:
        result["kineto"] = run_hta_comparison(cache, work, timeout_s, log, hta_trace_bytes, with_hta)
        if "hta" in result["kineto"]:
            k = result["kineto"]
            result["hta"] = {"version": HTA_VERSION, "wall_s": k["hta"]["wall_s"], "ours_wall_s": k["ours"]["wall_s"],
                             "speed_ratio": k["speed_ratio"], "figures_agree": k["figures_agree"],
                             "hta_overlap_pct": k["hta"]["comp_comm_overlap_pctg"],
                             "ours_whole_trace_overlap_pct": k["ours"]["whole_trace_overlap_pct"],
                             "trace_bytes": k["input"]["bytes"]}
    result["bytecode_warm_up"] = warm_ok
    result["load_average_1m"] = {"start": load_start, "end": round(os.getloadavg()[0], 2)}
    tmp = out_dir / ".profile_analyzer.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out_dir / "profile_analyzer.json")
    return result


def _peak_memory_text(run: dict) -> str:
    mb = 1e6
    what = "PSS" if run.get("tree_peak_pss_bytes") else "RSS"
    size = run.get("tree_peak_pss_bytes") or run["tree_peak_rss_bytes"]
    return f"{size / mb:,.0f} MB {what}, all processes ({run['peak_memory_vs_largest_file']:.2f}x the largest file)"


OURS_RUNS = 3


def _median_of(entry: dict, runs: list[Run], events: int | None, total_bytes: int | None, largest: int) -> Run:
    """Set ``entry``'s time to the median of ``runs`` (all of them in ``wall_s_runs``) and its memory to the largest
    run's; return the run whose memory is reported. ``events`` / ``total_bytes``: also the rates, where known."""
    walls = sorted(r.wall_s for r in runs)
    wall = walls[len(walls) // 2]
    peak = max(runs, key=lambda r: r.tree_peak_bytes)
    entry.update({"wall_s": round(wall, 3), "wall_s_runs": [round(r.wall_s, 3) for r in runs],
                  **_tree_memory(peak, largest)})
    if events is not None:
        entry["events_per_s"] = round(events / wall)
    if total_bytes is not None:
        entry.update({"mb_per_s": round(total_bytes / 1e6 / wall, 1), "peak_rss_bytes": peak.peak_rss_bytes})
    return peak


def _runs_text(entry: dict) -> str:
    runs = entry.get("wall_s_runs", [])
    return f" (median of {', '.join(f'{w:.1f}' for w in runs)})" if len(runs) > 1 else ""


def format_table(res: dict) -> str:
    mb = 1e6
    inp, ours = res["input"], res["ours"]
    rows = [
        ("input", f"{inp['ranks']} ranks, {inp['trace_view_bytes'] / mb:,.0f} MB trace_view.json, "
                  f"{inp['events']:,} events (largest file {inp['largest_file_bytes'] / mb:,.0f} MB)"),
        ("profile-analyzer report: time", f"{ours['wall_s']:.1f} s{_runs_text(ours)} (figures match the generator's "
                                          f"ground truth: {'yes' if ours['matches_ground_truth'] else 'NO'})"),
        ("profile-analyzer report: events/s", f"{ours['events_per_s']:,} ({ours['mb_per_s']} MB/s)"),
        ("profile-analyzer report: peak memory", f"{_peak_memory_text(ours)} (--jobs {ours['jobs']})"),
        ("", f"RSS summed over the processes {ours['tree_peak_rss_bytes'] / mb:,.0f} MB "
             f"({ours['peak_rss_vs_largest_file']:.2f}x; counts the pages forked workers share with the parent "
             f"once per process), largest one process {ours['peak_rss_bytes'] / mb:,.0f} MB"),
    ]
    if "ours_jobs1" in res:
        o1 = res["ours_jobs1"]
        rows.append(("profile-analyzer report --jobs 1", f"{o1['wall_s']:.1f} s{_runs_text(o1)}, "
                                                        f"{o1['events_per_s']:,} events/s, "
                                                        f"peak {_peak_memory_text(o1)}"))
    rows.append(("memory target (--jobs 1)", f"< {MEMORY_TARGET:g}x the largest file: "
                                             f"{'met' if res['meets_memory_target'] else 'NOT met'}"))
    if "ours_phases" in res:
        ph = res["ours_phases"]
        rows.append(("profile-analyzer phases", f"import {ph['import_s']:.1f} s, load {ph['load_s']:.1f} s, "
                                                f"analyze {ph['analyze_s']:.1f} s, render json {ph['render_json_s']:.1f} s"))
        if "decode_whole_files_s" in ph:
            rows.append(("msgspec decode of the traces", f"{ph['decode_whole_files_s']:.1f} s into the loader's structs "
                                                         f"(whole files), {ph['parse_floor_s']:.1f} s to parse them "
                                                         f"keeping no field"))
        rows.append(("profile-analyzer RSS high-water", f"after load {ph['rss_hwm_after_load'] / mb:,.0f} MB, "
                                                        f"after analyze {ph['rss_hwm_after_analyze'] / mb:,.0f} MB"))
    if "msprof_analyze" in res:
        m = res["msprof_analyze"]
        rows += [
            (f"msprof-analyze {m['version']} compare: time", f"{m['wall_s']:.1f} s ({len(m['runs'])} pairs)"),
            (f"msprof-analyze {m['version']} compare: peak RSS", f"{m['peak_rss_bytes'] / mb:,.0f} MB, all processes"),
            ("speed ratio (msprof-analyze / ours)", f"{res['speed_ratio']:.1f}x (target >= {SPEED_TARGET:g}x: "
                                                    f"{'met' if res['meets_speed_target'] else 'NOT met'})"),
        ]
        if "speed_ratio_jobs1" in res:
            rows.append(("speed ratio with --jobs 1", f"{res['speed_ratio_jobs1']:.1f}x (target >= {SPEED_TARGET:g}x: "
                                                      f"{'met' if res.get('meets_speed_target_jobs1') else 'NOT met'})"))
    else:
        rows.append(("msprof-analyze", "skipped (--no-msprof)"))
    if "kineto" in res:
        k = res["kineto"]
        ki, ko = k["input"], k["ours"]
        rows += [
            ("Kineto input", f"{ki['bytes'] / mb:,.0f} MB, {ki['events']:,} events ({ki['repeats']} copies of HTA's "
                             f"{ki['source']})"),
            ("profile-analyzer report --jobs 1", f"{ko['wall_s']:.1f} s (median of "
                                                 f"{', '.join(f'{w:.1f}' for w in ko['wall_s_runs'])}), peak "
                                                 f"{_peak_memory_text(ko)}; whole-trace overlap "
                                                 f"{ko['whole_trace_overlap_pct']:.2f}"),
        ]
        if "hta" in k:
            h = k["hta"]
            rows += [
                (f"HTA {h['version']} get_comm_comp_overlap", f"{h['wall_s']:.1f} s, peak RSS "
                                                              f"{h['tree_peak_rss_bytes'] / mb:,.0f} MB; overlap "
                                                              f"{h['comp_comm_overlap_pctg']}"),
                ("figures agree (to 0.01)", "yes" if k["figures_agree"] else "NO"),
                ("speed ratio (HTA / ours)", f"{k['speed_ratio']:.1f}x (target >= {SPEED_TARGET:g}x: "
                                             f"{'met' if k['meets_speed_target'] else 'NOT met'})"),
            ]
        else:
            rows.append(("HTA", "skipped (--no-hta)"))
    if "load_average_1m" in res:
        la = res["load_average_1m"]
        rows.append(("load average (1 min)", f"{la['start']:.2f} at the start, {la['end']:.2f} at the end"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profile_analyzer.bench",
                                     description="profile-analyzer vs msprof-analyze on a generated 8-rank profile, "
                                                 "and vs HTA on a large Kineto trace")
    parser.add_argument("--out", default="bench-results", help="where profile_analyzer.json goes")
    parser.add_argument("--cache", default=None, help="cache folder (default: <repo>/.cache)")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--target-bytes", type=int, default=GIB, help="total trace_view.json size (default 1 GiB)")
    parser.add_argument("--no-msprof", action="store_true", help="measure profile-analyzer only")
    parser.add_argument("--cprofile", action="store_true", help="also write a cProfile of our run")
    parser.add_argument("--phases", action="store_true",
                        help="also time our import/load/analyze/render phases and their memory high-water marks")
    parser.add_argument("--no-hta", action="store_true", help="do not run HTA (our side of the Kineto trace still runs)")
    parser.add_argument("--no-kineto", action="store_true", help="leave out the Kineto trace (ours and HTA)")
    parser.add_argument("--hta-trace-bytes", type=int, default=HTA_TRACE_BYTES,
                        help=f"size of the repeated Kineto trace (default {HTA_TRACE_BYTES:,})")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed per measured command")
    parser.add_argument("--jobs", type=int, default=1,
                        help="profile-analyzer report --jobs N (processes loading ranks; default 1, the run the "
                             "memory target is about); with N > 1 the one-process run is measured as well")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.target_bytes < 1 or args.hta_trace_bytes < 1:
        print("profile_analyzer.bench: --ranks, --target-bytes and --hta-trace-bytes must be positive", file=sys.stderr)
        return 2
    cache = Path(args.cache) if args.cache else repo_root() / ".cache"
    try:
        res = run_bench(Path(args.out), cache=cache, ranks=args.ranks, target_bytes=args.target_bytes,
                        with_msprof=not args.no_msprof, timeout_s=args.timeout, cprofile=args.cprofile,
                        phases=args.phases, jobs=max(1, args.jobs), with_hta=not args.no_hta,
                        kineto=not args.no_kineto, hta_trace_bytes=args.hta_trace_bytes)
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
        print(f"profile_analyzer.bench: {exc}", file=sys.stderr)
        return 1
    print("\nprofile-analyzer benchmark")
    print(format_table(res))
    print(f"written: {Path(args.out) / 'profile_analyzer.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

