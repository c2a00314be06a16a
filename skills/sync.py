#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = []
# ///
"""Write the files several skills share into each skill folder, so that every skill works copied alone.

    python skills/sync.py            # write the copies (what `make skills-sync` runs)
    python skills/sync.py --check    # list copies that differ from their source; exit 1 if any

Each shared file has one source, named below; the copies are byte-identical and are committed (an agent
installs a skill by copying its folder, without this repository). Edit the source, then run this.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

SKILLS = Path(__file__).resolve().parent
EVERY_SKILL = "*"

# (source relative to skills/, destination relative to a skill folder, the skills that get it)
SHARED: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("render.py", "scripts/render.py", (EVERY_SKILL,)),
    ("job.py", "scripts/job.py", (EVERY_SKILL,)),
    ("long-runs.md", "references/long-runs.md", (EVERY_SKILL,)),
    ("../LICENSE", "LICENSE", (EVERY_SKILL,)),
    ("dbo-debug/assets/launch_server.sh.j2", "assets/launch_server.sh.j2", ("profile-overlap-analysis",)),
    ("dbo-debug/assets/launch_server.values.yaml", "assets/launch_server.values.yaml", ("profile-overlap-analysis",)),
    ("dbo-debug/assets/capture_profile.sh.j2", "assets/capture_profile.sh.j2", ("profile-overlap-analysis",)),
    ("dbo-debug/assets/capture_profile.values.yaml", "assets/capture_profile.values.yaml", ("profile-overlap-analysis",)),
    ("dbo-debug/assets/precision_compare.py.j2", "assets/precision_compare.py.j2", ("dbo-benchmark",)),
    ("dbo-debug/assets/precision_compare.values.yaml", "assets/precision_compare.values.yaml", ("dbo-benchmark",)),
    ("vllm-serve-bench/scripts/serve_bench.py", "scripts/serve_bench.py", ("dbo-benchmark",)),
    ("vllm-serve-bench/scripts/vllm_bench_serve.py", "scripts/vllm_bench_serve.py", ("dbo-benchmark",)),
    ("vllm-serve-bench/scripts/bench_client.py", "scripts/bench_client.py", ("dbo-benchmark",)),
    ("vllm-serve-bench/assets/matrix.yaml.j2", "assets/matrix.yaml.j2", ("dbo-benchmark",)),
    ("vllm-serve-bench/assets/matrix.values.yaml", "assets/matrix.values.yaml", ("dbo-benchmark",)),
    ("vllm-serve-bench/assets/ablation-910b.yaml", "assets/ablation-910b.yaml", ("dbo-benchmark",)),
    ("vllm-serve-bench/references/matrix-format.md", "references/matrix-format.md", ("dbo-benchmark",)),
    ("vllm-serve-bench/references/results.md", "references/results.md", ("dbo-benchmark",)),
)


def skill_names(root: Path = SKILLS) -> list[str]:
    return sorted(p.parent.name for p in root.glob("*/SKILL.md"))


def copies(root: Path = SKILLS) -> list[tuple[Path, Path]]:
    """(source, copy) for every shared file and every skill that carries it."""
    pairs = []
    for source, destination, targets in SHARED:
        # A skill that is not there (yet) gets nothing; every skill with a SKILL.md gets the shared files.
        names = [n for n in (skill_names(root) if EVERY_SKILL in targets else targets) if (root / n / "SKILL.md").is_file()]
        src = (root / source).resolve()
        pairs += [(src, root / name / destination) for name in names if (root / name).resolve() != src.parents[1]]
    return pairs


def stale(root: Path = SKILLS) -> list[str]:
    """Copies that are missing or differ from their source (paths relative to skills/)."""
    return [
        str(dst.relative_to(root))
        for src, dst in copies(root)
        if not dst.is_file() or dst.read_bytes() != src.read_bytes() or os.access(dst, os.X_OK) != os.access(src, os.X_OK)
    ]


def write(root: Path = SKILLS) -> list[str]:
    written = []
    for src, dst in copies(root):
        if dst.is_file() and dst.read_bytes() == src.read_bytes() and os.access(dst, os.X_OK) == os.access(src, os.X_OK):
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=str(dst.parent))
        os.close(fd)
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
        written.append(str(dst.relative_to(root)))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sync.py", description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="only list the copies that differ; exit 1 if any")
    args = parser.parse_args(argv)
    missing = [src for src, _ in copies() if not src.is_file()]
    if missing:
        print(f"sync.py: source {missing[0]} does not exist", file=sys.stderr)
        return 2
    if args.check:
        for path in stale():
            print(f"differs from its source: skills/{path} (run `make skills-sync`)")
        return 1 if stale() else 0
    for path in write():
        print(f"wrote skills/{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
