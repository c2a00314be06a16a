"""Synthetic multi-card torch_npu profiles with a ground truth known by construction.

No public multi-card Ascend trace with a populated communication track exists, and no NPU exists here, so
this module is a *stand-in for an NPU run*: it simulates the device streams of an MoE decoder (see
``synth.schedule``) on N ranks and writes, per rank, the directory torch_npu would write::

    OUT_DIR/
      ground_truth.json                       what the analyzer must find (µs, per rank and step)
      node0_437675_<stamp>_ascend_pt/
        profiler_info_0.json  profiler_metadata.json
        ASCEND_PROFILER_OUTPUT/
          trace_view.json  kernel_details.csv  step_trace_time.csv  communication.json

``trace_view.json`` holds the tracks the Ascend profiler names (Python, CANN, Ascend Hardware with
``Stream N`` threads, ``Communication``/``HCCL`` with ``Group ... Communication`` and ``Plane N`` threads,
``Overlap Analysis`` with Computing / Communication / Communication(Not Overlapped) / Free). The
``Overlap Analysis`` track and ``step_trace_time.csv`` are computed with msprof's and torch_npu's
definitions from the simulated tasks, so an analyzer that recomputes them from the raw tasks must match
them, and ``ground_truth.json`` adds what the profiler does not write (exposed communication per layer
and operator, coverage of each micro-batch's communication by the other's compute, per-stream busy
time, each rank's wait).

With ``export="db"`` each rank holds the DB export instead (``ascend_pytorch_profiler_{rank}.db`` and
``analysis.db``, torch_npu's ``export_type=db``), with ``"both"`` both exports side by side; the DB is written
from the text export (:mod:`profile_analyzer.synth.db_export`), so both describe the same run.

Usage: ``write_profile(tmp_path, ranks=2, steps=2, layers=4, dbo=True)`` or
``profile-analyzer synth OUT_DIR --ranks 8 --steps 4 --layers 61 --dbo [--export db|json|both]``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path

from profile_analyzer.synth.schedule import SynthParams
from profile_analyzer.synth.writer import write_rank

__all__ = ["GroundTruth", "SynthParams", "write_profile"]

GROUND_TRUTH_FILE = "ground_truth.json"


@dataclass
class GroundTruth:
    """What a correct analysis of the generated profile finds. Times in µs (exact to the ns)."""

    params: dict
    ranks: dict[int, dict]
    root: Path
    profile_dirs: dict[int, Path] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.root / GROUND_TRUTH_FILE

    def step(self, rank: int, step: int) -> dict:
        """The figures of ``step`` (1-based, as in ``ProfilerStep#N``) on ``rank``."""
        for s in self.ranks[rank]["steps"]:
            if s["step"] == step:
                return s
        raise KeyError(f"rank {rank} has no step {step}")

    def steps(self, rank: int) -> list[dict]:
        return self.ranks[rank]["steps"]

    @property
    def slowest_rank(self) -> int | None:
        """The rank the others wait for: it arrives last at every collective, so it waits least."""
        if len(self.ranks) < 2:
            return None
        return min(self.ranks, key=lambda r: self.ranks[r]["totals"]["comm_wait_us"])

    @property
    def total_bytes(self) -> int:
        return sum(r["trace_view_bytes"] for r in self.ranks.values())

    @property
    def total_events(self) -> int:
        return sum(r["events"] for r in self.ranks.values())

    def to_dict(self) -> dict:
        return {
            "generator": "profile_analyzer.synth",
            "note": "synthetic stand-in for an Ascend NPU run; figures follow msprof/torch_npu definitions",
            "units": "microseconds",
            "params": self.params,
            "slowest_rank": self.slowest_rank,
            "total_trace_view_bytes": self.total_bytes,
            "total_events": self.total_events,
            "ranks": {str(r): v for r, v in sorted(self.ranks.items())},
        }

    @classmethod
    def load(cls, root: str | Path) -> GroundTruth:
        root = Path(root)
        d = json.loads((root / GROUND_TRUTH_FILE).read_text())
        ranks = {int(r): v for r, v in d["ranks"].items()}
        return cls(d["params"], ranks, root, {r: root / v["profile_dir"] for r, v in ranks.items()})


EXPORTS = ("json", "db", "both")
TEXT_EXPORT_FILES = ("trace_view.json", "kernel_details.csv", "step_trace_time.csv", "communication.json")


def _rank_job(args: tuple[SynthParams, int, str, str]) -> dict:
    p, rank, root, export = args
    res = write_rank(p, rank, root)
    if export != "json":
        from profile_analyzer.synth.db_export import write_db_export

        rank_dir = Path(root) / res["profile_dir"]
        write_db_export(rank_dir, rank)
        info = rank_dir / f"profiler_info_{rank}.json"
        d = json.loads(info.read_text())
        d["config"]["experimental_config"]["_export_type"] = ["db"] if export == "db" else ["text", "db"]
        info.write_text(json.dumps(d, indent=1))
        if export == "db":
            for name in TEXT_EXPORT_FILES:
                (rank_dir / "ASCEND_PROFILER_OUTPUT" / name).unlink()
    return res


def write_profile(out_dir: str | Path, *, ranks: int = 2, steps: int = 2, layers: int = 4, pattern: str = "a2",
                  dbo: bool = False, comm_fraction: float = 0.3, seed: int = 0, workers: int | None = None,
                  export: str = "json", overwrite: bool = False, **options: object) -> GroundTruth:
    """Write an N-rank torch_npu-format profile under ``out_dir`` and return its ground truth.

    ``options`` are the other :class:`SynthParams` fields: ``exposed_layers`` (DBO layers whose collectives
    are ``exposed_factor`` times too long to hide), ``cann`` ("new"/"old"), ``comm_process_name``
    ("Communication"/"HCCL"), ``stream_id_key`` ("Physic Stream Id"/"Stream Id"), ``ts_as_string``,
    ``large_pids``, ``host_tracks``, ``sync_tasks``, ``planes``, ``slow_rank``, ``slow_factor``,
    ``layer_compute_us``, ``shared_expert_cover``, ``pp_receive_us`` (each step starts with an
    ``hcom_receive`` of about that length: the Bubble column). ``workers`` > 1 writes ranks in parallel.

    ``out_dir`` must be new or an empty directory; with ``overwrite`` it may hold files, and the rank folders and
    ground truth of the same names are replaced (anything else in it is kept). Otherwise ValueError, before
    anything is written. Nothing partial is left behind: the profile is written into a temporary folder beside
    ``out_dir`` and renamed to it (or moved into it) at the end; an error or a signal removes the temporary folder.
    """
    if export not in EXPORTS:
        raise ValueError(f"export must be one of {', '.join(EXPORTS)}, not {export!r}")
    known = {f.name for f in fields(SynthParams)}
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"unknown synth option(s): {', '.join(sorted(unknown))}")
    if "exposed_layers" in options:
        options["exposed_layers"] = tuple(options["exposed_layers"])  # type: ignore[arg-type]
    p = SynthParams(ranks=ranks, steps=steps, layers=layers, pattern=pattern, dbo=dbo, comm_fraction=comm_fraction,
                    seed=seed, **options)  # type: ignore[arg-type]
    p.validate()
    p = p.resolved()
    out = Path(out_dir)
    _check_destination(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.synth-", dir=out.parent))
    try:
        if workers is None:
            work = ranks * steps * layers * (2 if dbo else 1)
            workers = min(ranks, os.cpu_count() or 1) if work > 2000 else 1
        jobs = [(p, r, str(tmp), export) for r in range(ranks)]
        if workers > 1:
            from profile_analyzer._pool import map_in_processes

            # the loader's pool: workers die with the parent, and a SIGTERM or an error stops them without a
            # traceback of theirs
            results: list[dict] = [{} for _ in jobs]
            map_in_processes(_rank_job, [(j,) for j in jobs], workers, results.__setitem__)
        else:
            results = [_rank_job(j) for j in jobs]
        params = {f.name: getattr(p, f.name) for f in fields(SynthParams)}
        params["exposed_layers"] = list(p.exposed_layers)
        params["export"] = export
        truth = GroundTruth(params, {res["rank"]: res for res in results}, out)
        (tmp / GROUND_TRUTH_FILE).write_text(json.dumps(truth.to_dict(), indent=1))
        names = [res["profile_dir"] for res in results] + [GROUND_TRUTH_FILE]
        if out.exists():  # an empty folder, or overwrite: the new entries replace those of the same names
            for name in names:
                dst = out / name
                if dst.is_dir() and not dst.is_symlink():
                    shutil.rmtree(dst)
                elif dst.exists() or dst.is_symlink():
                    dst.unlink()
                os.replace(tmp / name, dst)
        else:
            os.rename(tmp, out)
        for res in results:
            truth.profile_dirs[res["rank"]] = out / res["profile_dir"]
        return truth
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_destination(out: Path, overwrite: bool) -> None:
    """ValueError when ``out`` cannot take a new profile: an existing file, or a folder with something in it
    (without ``overwrite``)."""
    if out.is_symlink() and not out.exists():
        raise ValueError("a dangling symbolic link; expected a new or empty folder")
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError("exists and is not a folder; expected a new or empty folder")
    if overwrite:
        return
    try:
        has_entries = next(out.iterdir(), None) is not None
    except OSError as exc:
        raise ValueError(f"cannot be listed ({exc.strerror or exc}); expected a new or empty folder") from None
    if has_entries:
        raise ValueError("exists and is not empty (a profile is not written over another); expected a new or "
                         "empty folder, or --overwrite to replace its rank folders and ground_truth.json")


# --------------------------------------------------------------------------------------------------
# CLI
