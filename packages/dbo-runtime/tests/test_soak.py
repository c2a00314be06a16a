"""The soak's own parts that need no engine (``dbo_runtime.vllm.soak``): vLLM's metrics text, the request mix, the
outputs it writes, and its command line. The soak itself (``make soak``) and the serving helpers under a real
engine are exercised by ``test_vllm_hard_cases.py``."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from dbo_runtime.vllm import soak

METRICS = """# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 6.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 1.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 16.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""


def test_metrics_are_summed_over_label_sets_and_split_by_finish_reason() -> None:
    m = soak.parse_metrics(METRICS)
    assert m[soak.PREEMPTIONS] == 6.0 and m[soak.KV_USAGE] == 0.0 and m[soak.RUNNING] == 0.0
    assert m[soak.FINISHED] == 17.0
    assert m["vllm:request_success_total[finished_reason=length]"] == 16.0


def test_the_mix_stays_under_max_model_len_and_has_every_case() -> None:
    mix = soak.SoakMix()
    rng = random.Random(0)
    specs = [mix.spec(rng, i) for i in range(2000)]
    words = [len(p.split()) for p, _, _ in specs]
    # ~3 tokens a word at most with the tiny model's tokenizer (measured 2.6-3.0): prompt + output < 1024
    assert max(words) * 3 + mix.max_tokens[1] < 1024
    assert max(words) * 2.6 > 256  # some prompts are above --max-num-batched-tokens 256: chunked prefill
    assert 0.3 < sum(p.startswith("Document ") for p, _, _ in specs) / len(specs) < 0.5  # shared prefixes
    aborts = [(m, a) for _, m, a in specs if a is not None]
    assert 0.05 < len(aborts) / len(specs) < 0.15 and all(1 <= a <= m for m, a in aborts)
    assert soak.prompt_of(3, 10, prefix=1, prefix_words=60).startswith(
        soak.prompt_of(9, 5, prefix=1, prefix_words=60).split("Question")[0])


def test_outputs_written_summary_csv_json_and_figure(tmp_path: Path) -> None:
    rows = [{"variant": "thread", "t_s": float(t), "rss_mb": 2500.0 + t, "threads": 150, "processes": 5,
             "served": t, "aborted": 0, "failed": 0, "split_steps": t, "steps": 2 * t} for t in range(0, 30, 5)]
    result = {"variant": "thread", "minutes": 0.5, "elapsed_s": 30.0, "concurrency": 32, "server_start_s": 40.0,
              "served": 25, "aborted": 3, "failed": 0, "errors": [], "alive_at_end": True, "split_steps": 25,
              "steps": 50, "ranks": {}, "preemptions": 2.0, "prefix_hits": 320.0, "prefix_queries": 900.0,
              "idle_kv_usage_before": 0.0, "kv_usage_end": 0.0, "running_end": 0.0, "waiting_end": 0.0,
              "rss_mb_first": 2500.0, "rss_mb_last": 2525.0, "rss_mb_max": 2525.0, "threads_first": 150,
              "threads_last": 150, "threads_max": 150, "rows": rows, "completed": [{"prompt": "x"}],
              "sample": {"size": 1, "identical": 1, "first_difference": None}}
    settings = {"minutes": 0.5, "variants": ["thread"], "concurrency": 32, "engine_args": soak.SOAK_ENGINE_ARGS,
                "model": "m", "mix": vars(soak.SoakMix()), "sample_size": 1}
    soak.write_outputs(tmp_path, [result], settings)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["soak.png", "summary.json", "summary.md", "timeseries.csv"]
    assert "| thread | 25 | 3 | 0 | 25 / 50 |" in (tmp_path / "summary.md").read_text()
    assert len((tmp_path / "timeseries.csv").read_text().splitlines()) == len(rows) + 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "rows" not in summary["variants"][0] and "completed" not in summary["variants"][0]


def test_unknown_variant_is_refused_before_anything_starts(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dbo_runtime.vllm.soak", "--variants", "thread,fibre",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "accepted: a comma-separated list of thread, greenlet, auto" in lines[0]
    assert not (tmp_path / "out").exists()


def _run(ids: list[int], tops: list[dict[int, float]]) -> soak.Result:
    return soak.Result("p", len(ids), token_ids=ids, top_logprobs=tops)


def test_difference_names_the_first_token_or_logprob_that_parts() -> None:
    base = [{1: -0.1, 2: -2.5}, {3: -0.60, 4: -0.62}, {5: -0.2, 6: -1.9}]
    assert soak.difference(_run([1, 3, 5], base), _run([1, 3, 5], [dict(t) for t in base])) is None
    # same tokens, but the second token's logprobs moved: the computation changed even though greedy did not
    moved = [base[0], {3: -0.60, 4: -0.625}, base[2]]
    assert soak.difference(_run([1, 3, 5], base), _run([1, 3, 5], moved)).startswith("token 1: top logprobs differ")
    assert soak.difference(_run([1, 3, 5], base), _run([1, 4, 5], base)) == "token 1: 3 vs 4"
    assert soak.difference(_run([1, 3, 5], base), _run([1, 3], base[:2])).startswith("lengths differ")
    # without logprobs: tokens only; without token ids: text
    assert soak.difference(soak.Result("p", 2, token_ids=[1, 3]), soak.Result("p", 2, token_ids=[1, 3])) is None
    assert soak.difference(soak.Result("p", 1, text="a"), soak.Result("p", 1, text="b")) is not None


def test_top_logprobs_are_keyed_by_token_id() -> None:
    chunk = {"top_logprobs": [{"token_id:17": -0.5, "token_id:3": -1.25}, {"token_id:4": -0.1}]}
    assert soak._top_by_id(chunk) == [{17: -0.5, 3: -1.25}, {4: -0.1}]
    assert soak._top_by_id(None) == []
