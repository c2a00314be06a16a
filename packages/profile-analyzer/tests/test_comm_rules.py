"""The vendor communication rule table (loaders/comm_rules.py), --comm-pattern, and the fused kind."""

from __future__ import annotations

import csv
import gzip
import json
import subprocess
import sys
from pathlib import Path

import profile_analyzer as pa
import pytest
from profile_analyzer.loaders.comm_rules import RULES, classify_name

DATA = Path(__file__).resolve().parent / "data"

# compute kernels and operators that no rule may take for communication (real names from the vendored traces, and
# the common GEMM / attention / MoE kernels of the same stacks)
COMPUTE_NAMES = [
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>(Params)",
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn",
    "void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>(Params)",
    "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, c10::BFloat16*, int)",
    "fused_moe_kernel", "MatMulV2", "MatMulV3", "GroupedMatmul", "FlashAttentionScore", "MoeGatingTopKSoftmax",
    "MoeInitRouting", "MoeFinalizeRouting", "aten::mm", "_C::onednn_mm", "_C::cpu_fused_moe",
    "vllm::unified_attention_with_output", "DispatchFFNCombine_is_not_a_kernel_name_here_but_a_compute_one",
]


def _real_kernel_names() -> set[str]:
    names: set[str] = set()
    for f in (DATA / "hta-kineto").glob("*.json.gz"):
        with gzip.open(f, "rt") as fh:
            names.update(e["name"] for e in json.load(fh)["traceEvents"] if e.get("cat") == "kernel")
    for f in (DATA / "msprof-sample" / "kernel_details").glob("*.csv"):
        with open(f, encoding="utf-8-sig") as fh:
            names.update(row["Name"] for row in csv.DictReader(fh))
    return names


def test_every_rule_names_its_source_and_matches_its_own_examples() -> None:
    assert len({r.name for r in RULES}) == len(RULES)
    for rule in RULES:
        assert rule.kind in ("communication", "fused") and len(rule.source) > 40 and rule.examples
        for ex in rule.examples:
            assert classify_name(ex) == (rule.kind, rule.name), (rule.name, ex)


def test_no_rule_takes_compute_for_communication() -> None:
    real = _real_kernel_names()
    assert len(real) > 300  # the kernels of HTA's NCCL traces and of the Ascend kernel_details samples
    wrong = {n: classify_name(n) for n in [*real, *COMPUTE_NAMES] if classify_name(n) is not None}
    assert not wrong


def test_deep_ep_kernels_and_mc2_kinds() -> None:
    assert classify_name("void deep_ep::intranode::notify_dispatch<8>(int const*, int*, int, int const*)")[0] == \
        "communication"
    assert classify_name("void deep_ep::internode::cached_notify(int, int, int, int, int, void*)")[0] == "communication"
    assert classify_name("MoeDistributeDispatchV2")[0] == "communication"
    assert classify_name("MatmulReduceScatter")[0] == "fused"
    assert classify_name("AllGatherMatmulV2")[0] == "fused"
    assert classify_name("HcclAicpuKernel")[0] == "communication"


def _gpu_trace(comm_kernel: str) -> dict:
    """One step: compute [0,100) and [150,250) on stream 7, one ``comm_kernel`` [80,180) on stream 20."""
    ev = [{"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 300}]
    corr = 0
    for name, stream, ts, dur in (("void gemm_kernel<bf16>(Params)", 7, 0, 100), (comm_kernel, 20, 80, 100),
                                  ("void gemm_kernel<bf16>(Params)", 7, 150, 100)):
        corr += 1
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": max(ts - 3, 0),
                   "dur": 1, "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                   "args": {"stream": stream, "correlation": corr, "device": 0}})
    return {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": ev}


def _report(tmp_path: Path, comm_kernel: str, *patterns: str) -> dict:
    f = tmp_path / "t.json"
    f.write_text(json.dumps(_gpu_trace(comm_kernel)))
    return pa.analyze(pa.load(f, comm_patterns=patterns)).to_dict()


def test_a_profile_whose_communication_is_deep_ep_reads_as_communication(tmp_path: Path) -> None:
    rep = _report(tmp_path, "void deep_ep::internode_ll::dispatch<false, 3, 7168>(void*, float*, int*)")
    s = rep["summary"]
    # [80,180) against compute [0,100) and [150,250): 20 + 30 under compute, 50 exposed
    assert (s["communication_us"], s["overlapped_us"], s["communication_not_overlapped_us"]) == (100.0, 50.0, 50.0)
    assert s["computing_us"] == 200.0 and s["fused_us"] == 0.0
    assert s["comm_rules"] == [{"rank": 0, "rule": "DeepEP", "kind": "communication", "tasks": 1}]
    assert "no communication operators" not in rep["verdict"]


def test_fused_kernel_counts_as_compute_and_communication(tmp_path: Path) -> None:
    rep = _report(tmp_path, "MatmulAllReduce")
    s = rep["summary"]
    # its 100 µs are in both sets: Computing = [0,250) = 250, Communication 100, all of it overlapped
    assert (s["computing_us"], s["communication_us"], s["overlapped_us"]) == (250.0, 100.0, 100.0)
    assert s["communication_not_overlapped_us"] == 0.0 and s["fused_us"] == 100.0


def test_comm_pattern_adds_a_users_kernel(tmp_path: Path) -> None:
    plain = _report(tmp_path, "void my_team::a2a_push_kernel<8>(void*)")
    assert plain["summary"]["communication_us"] == 0.0  # unknown to every rule: compute
    rep = _report(tmp_path, "void my_team::a2a_push_kernel<8>(void*)", r"a2a_push")
    assert rep["summary"]["communication_us"] == 100.0
    assert rep["summary"]["comm_rules"][0]["rule"] == "--comm-pattern a2a_push"


def test_comm_pattern_on_the_command_line(tmp_path: Path) -> None:
    f = tmp_path / "t.json"
    f.write_text(json.dumps(_gpu_trace("void my_team::a2a_push_kernel<8>(void*)")))
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "profile_analyzer", "report", str(f), "--format", "json", "-o", str(out),
           "--comm-pattern", "nothing_here", "--comm-pattern", "a2a_push"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text())["summary"]["communication_us"] == 100.0
    bad = subprocess.run([*cmd[:-4], "--comm-pattern", "a2a_(push"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "--comm-pattern" in bad.stderr and "not a regular expression" in bad.stderr


def test_bad_pattern_through_the_api_is_a_profile_error(tmp_path: Path) -> None:
    from profile_analyzer.errors import ProfileError

    with pytest.raises(ProfileError, match="not a regular expression"):
        pa.load(tmp_path, comm_patterns=["("])


def test_a_catastrophic_comm_pattern_runs_in_linear_time(tmp_path: Path) -> None:
    # with Python's backtracking re, `(a+)+$` against 64 a's and a '!' takes ~2**64 steps: the report hung
    f = tmp_path / "t.json"
    f.write_text(json.dumps(_gpu_trace("a" * 64 + "!")))
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "profile_analyzer", "report", str(f), "--format", "json", "-o", str(out),
           "--comm-pattern", "(a+)+$", "--comm-pattern", "(x+x+)+y"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a catastrophic --comm-pattern hung the report")
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text())["summary"]["communication_us"] == 0.0


@pytest.mark.parametrize("pattern", [r"(a)\1", r"(?<=hcom)_x", r"a(?=b)", "a" * 3 + "{1000}{1000}{1000}"])
def test_a_pattern_outside_re2_syntax_is_one_line_naming_the_engine(tmp_path: Path, pattern: str) -> None:
    f = tmp_path / "t.json"
    f.write_text(json.dumps(_gpu_trace("void my_team::a2a_push_kernel<8>(void*)")))
    res = subprocess.run([sys.executable, "-m", "profile_analyzer", "report", str(f), "--comm-pattern", pattern],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "--comm-pattern" in res.stderr and "RE2" in res.stderr and res.stdout == ""


# A vendor fork of DeepEP: DeepEP's kernel structure under a top namespace of its own, with the notify kernels moved
# out of the namespace (the shape of the public expert-parallel profile of issue 28).
FORK_DISPATCH = "void vendor_x::ep::internode::dispatch<true, 8, 4, 7168>(int4*, float*, int*, long*, int)"
FORK_COMBINE = "void vendor_x::ep::internode::combine<nv_bfloat16, 8, 4>(int4*, float*, int const*, int)"
FORK_NOTIFY = "void cached_notify_dispatch_kernel<8>(int const*, int, void**, int**, int)"


@pytest.mark.parametrize("name", [
    FORK_DISPATCH, FORK_COMBINE,
    "void vendor_x::ep::internode_ll::dispatch<false, 3, 7168>(void*, float*, int*)",
    "void uccl_ep::intranode::combine<nv_bfloat16, 8, 768>(int4*, float*)",
    "void vendor_x::ep::layout::get_dispatch_layout<256, 32, 8>(long const*, int*, int*, int*, bool*, int, int)",
    "void DeepEP::intranode::dispatch<8, 768, 8192>(int4*)",
    "void rocshmem::rocshmem_wg_barrier_all()", "mscclKernel_Sum_half_Simple_false",
    "void sglang::cross_device_reduce_2stage<half, 8>(sglang::RankData*)",
    "void my_a2a::intranode_combine_kernel<128>(void*)", "MatMulAllReduceV2", "aclnnMoeDistributeCombineV3_quant",
])
def test_forks_and_renames_keep_their_library_shape(name: str) -> None:
    # each of these defeated the table before: a fork's namespace, another capitalisation, another version suffix
    assert classify_name(name) is not None, name


def _fork_stream_trace() -> dict:
    """One step: GEMMs [0,300) on stream 7; the fork's comm stream 20 with notify [10,20), dispatch [20,120), notify
    [150,160), combine [160,260) (the kernels that ran in the issue's profile, times made up)."""
    ev = [{"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 400}]
    kernels = [("void gemm_kernel<bf16>(Params)", 7, 0, 300), (FORK_NOTIFY, 20, 10, 10), (FORK_DISPATCH, 20, 20, 100),
               (FORK_NOTIFY, 20, 150, 10), (FORK_COMBINE, 20, 160, 100)]
    for corr, (name, stream, ts, dur) in enumerate(kernels, 1):
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts,
                   "dur": 1, "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                   "args": {"stream": stream, "correlation": corr, "device": 0}})
    return {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": ev}


def test_a_deepep_fork_reads_as_communication(tmp_path: Path) -> None:
    f = tmp_path / "fork.json"
    f.write_text(json.dumps(_fork_stream_trace()))
    rep = pa.analyze(pa.load(f)).to_dict()
    # before: only the two notify kernels (20 µs) were communication, 200 µs of dispatch/combine were compute
    assert rep["summary"]["communication_us"] == 220.0
    assert {r["rule"]: r["tasks"] for r in rep["summary"]["comm_rules"]} == {
        "DeepEP": 2, "DeepEP kernel names without a namespace": 2}
    assert not [w for w in rep["warnings"] if "no communication rule names" in w["message"]]


def test_a_stream_with_unnamed_kernels_beside_communication_gets_one_warning(tmp_path: Path) -> None:
    from profile_analyzer.loaders import comm_rules

    trace = _fork_stream_trace()
    renamed = {FORK_DISPATCH: "void acme::moe::push_tokens<8>(int4*, float*)",
               FORK_COMBINE: "void acme::moe::pull_tokens<8>(int4*, float*)"}
    for e in trace["traceEvents"]:
        e["name"] = renamed.get(e["name"], e["name"])
    f = tmp_path / "renamed.json"
    f.write_text(json.dumps(trace))
    rep = pa.analyze(pa.load(f)).to_dict()
    assert rep["summary"]["communication_us"] == 20.0  # no rule can know these names
    (w,) = [w for w in rep["warnings"] if "no communication rule names" in w["message"]]
    assert "acme::moe::push_tokens (100.0 µs, 1 task)" in w["message"] and "acme::moe::pull_tokens" in w["message"]
    assert "gemm_kernel" not in w["message"]  # the GEMMs are on another stream
    pattern = w["message"].split("--comm-pattern '")[1].rstrip("'")
    assert pattern == comm_rules.suggested_pattern(list(renamed.values()))
    # the pattern the warning gives counts them, and the warning goes
    again = pa.analyze(pa.load(f, comm_patterns=[pattern])).to_dict()
    assert again["summary"]["communication_us"] == 220.0
    assert not [w for w in again["warnings"] if "no communication rule names" in w["message"]]
    # printed on stderr by `report`, one line
    res = subprocess.run([sys.executable, "-m", "profile_analyzer", "report", str(f), "--format", "json", "-o",
                          str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stderr.count("no communication rule names") == 1, res.stderr


def test_a_compute_stream_with_an_mc2_dispatch_raises_no_warning() -> None:
    from profile_analyzer.loaders.comm_rules import mixed_stream_warnings
    from profile_analyzer.timeline import Kind, TimelineBuilder

    b = TimelineBuilder()
    s = b.stream_index(("hw", 1), "Stream 1", "compute")
    names = ["MatMulV3", "FlashAttentionScore", "MoeDistributeDispatchV2", "GroupedMatmul", "MoeDistributeCombineV2",
             "AddRmsNorm", "MatMulV3", "Cast"]
    ids = b.intern(names)
    n = len(names)
    import numpy as np

    starts = np.arange(n, dtype=np.int64) * 100
    kinds = np.array([int(Kind.COMMUNICATION) if "Distribute" in x else int(Kind.COMPUTE) for x in names], np.int8)
    b.add(starts, starts + 90, s, kinds, ids)
    rt = b.build(0, "x", "torch_npu")
    assert mixed_stream_warnings(rt) == []  # 2 of 8 kernels: a compute stream, and no unnamed name reads as comm
    rt.name_id[-1] = b.intern(["my_a2a_dispatch_kernel"])[0]
    rt.names = b.names
    (w,) = mixed_stream_warnings(rt)
    assert "my_a2a_dispatch_kernel" in w.message() and "MatMulV3" not in w.message()
