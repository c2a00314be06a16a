"""`dbo-runtime doctor` against the real vllm-ascend 0.23.0.post1 sdist and vLLM 0.23.0 wheel from PyPI.

The archives are downloaded once with pip (no install, no dependencies) into <repo>/.cache/dbo-runtime/, which git
ignores; a failed download fails these tests and says why. The torch-npu 2.10.0.post4 wheel (the host pair's other
half) is read from the same folder when it is there (tests that need it skip otherwise); it is never imported.
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import pytest
from dbo_runtime.ascend import doctor
from dbo_runtime.ascend.runner import PER_UBATCH_STATE
from dbo_runtime.ascend.sites import (
    FORWARD_CONTEXT_CALL,
    OP_REGISTRATIONS,
    PATCHED_SYMBOLS,
    REFUSED_MODELS,
    ROTARY_MLA_BUFFER,
    SITES,
    SUPPORTED_MODELS,
    UBATCH_STATE_FACTS,
    VLLM_SYMBOLS,
)
from dbo_runtime.ascend.source import (
    REFERENCE_VLLM_ASCEND_VERSION,
    REFERENCE_VLLM_VERSION,
    download_release,
    open_source,
    runtime_source,
)
from dbo_runtime.cli import main as cli_main
from dbo_runtime.errors import DBOConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]
CACHE = REPO_ROOT / ".cache" / "dbo-runtime"

# The relied-on facts beside the sites (sites.py: ATTN_STATE, ROTARY_MLA_BUFFER, UBATCH_STATE_FACTS,
# DEFAULT_GROUP_BACKEND, MODEL_FORWARD, FORWARD_CONTEXT_CALL, TORCH_PAIR).
FACT_ROWS = ({"attn_state.members", "attn_state.rule", "attn_state.prefill_no_cache", "rotary.mla_buffer",
              "dist.default_backend", "runner.model_forward_parts", "forward_context.ascend_call", "host.torch_pair"}
             | {f"rotary.caller {cls}" for _, cls in ROTARY_MLA_BUFFER.callers}
             | {f"ubatch_state {f.cls}" for f in UBATCH_STATE_FACTS})

# What prepare stores and finalize reads on the shared instance in 0.23.0.post1 (read by hand from
# ops/fused_moe/prepare_finalize.py; the doctor derives it with ast).
CARRIED_0_23 = {
    "PrepareAndFinalizeWithAllGather": ("enable_shared_expert_dp", "num_tokens", "num_tokens_pcp"),
    "PrepareAndFinalizeWithAll2All": ("enable_shared_expert_dp", "num_tokens", "replace_allreduce"),
}

# Classes whose prepare/finalize pair the runtime's PER_UBATCH_STATE does not cover yet (the All2All entries are
# being added to runner.py separately): their row fails on the real release, naming the attributes, until then.
STATE_GAPS = {f"ubatch_state {f.cls}" for f in UBATCH_STATE_FACTS
              if not all(key in PER_UBATCH_STATE for key in doctor.state_keys(f))}

# PER_UBATCH_STATE as it must be for 0.23.0.post1: every class of UBATCH_STATE_FACTS covered.
COMPLETE_STATE = {key: CARRIED_0_23[f.cls] for f in UBATCH_STATE_FACTS for key in doctor.state_keys(f)}

# The host pair an Ascend host of this release has: torch_npu 2.10.0.post4, which requires torch==2.10.0+cpu.
ASCEND_HOST = {"torch": doctor.HostDist("2.10.0+cpu"),
               "torch-npu": doctor.HostDist("2.10.0.post4", ("torch ==2.10.0+cpu",))}


def _fetch(package: str, version: str) -> Path:
    try:
        return download_release(CACHE, package, version)
    except DBOConfigError as exc:
        pytest.fail(f"could not download {package}=={version} from PyPI into {CACHE}: {exc}")


@pytest.fixture(scope="module")
def ascend_sdist() -> Path:
    return _fetch("vllm-ascend", REFERENCE_VLLM_ASCEND_VERSION)


@pytest.fixture(scope="module")
def vllm_wheel() -> Path:
    return _fetch("vllm", REFERENCE_VLLM_VERSION)


@pytest.fixture(scope="module")
def ascend_tree(ascend_sdist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist unpacked (only the vllm_ascend package and PKG-INFO), as a plain source tree."""
    root = tmp_path_factory.mktemp("ascend-tree")
    release_files = ("PKG-INFO", "requirements.txt", "pyproject.toml", "setup.py")  # where the pins are
    with tarfile.open(ascend_sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.isfile() and ((m.name.split("/")[1:2] == ["vllm_ascend"] and m.name.endswith(".py"))
                                      or (m.name.count("/") == 1 and m.name.split("/")[1] in release_files))]
        tar.extractall(root, members=members, filter="data")
    (top,) = list(root.iterdir())
    return top


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = cli_main(["doctor", *argv, "--format", "json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_real_sdist_and_wheel_resolve_every_site(ascend_sdist: Path, vllm_wheel: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, payload = _run_json(capsys, "--vllm-ascend", str(ascend_sdist), "--vllm", str(vllm_wheel))
    bad = [r for r in payload["results"] if not r["ok"] and r["name"] not in STATE_GAPS]
    assert not bad, bad
    assert code == (1 if STATE_GAPS else 0)
    assert payload["vllm_ascend"]["version"] == REFERENCE_VLLM_ASCEND_VERSION
    assert payload["vllm"]["version"] == REFERENCE_VLLM_VERSION
    names = {r["name"] for r in payload["results"]}
    assert names == ({s.name for s in (*SITES, *PATCHED_SYMBOLS, *VLLM_SYMBOLS)} | {f"op {r.op}" for r in OP_REGISTRATIONS}
                     | {f"model {m.architecture}" for m in SUPPORTED_MODELS} | {f"model {a}" for a in REFUSED_MODELS}
                     | {"runner.builders_per_group"} | FACT_ROWS)
    by_name = {r["name"]: r for r in payload["results"]}
    assert all(by_name[s.name]["found"] for s in SITES)
    # The reset the plugin undoes is where the table says it is.
    assert any(re.search(r"resets enable_dbo at vllm_ascend/platform\.py:\d+", n)
               for n in by_name["platform.dbo_reset"]["notes"])
    # structural facts: the runner makes one builder per group (the runtime adds the second), the FlashComm1 ops
    # are registered for PrivateUse1 with the impls whose collectives are routed, every supported model maps to
    # the class the table names with no per-request state
    assert "1 builder per group" in by_name["runner.builders_per_group"]["notes"][0]
    assert all(by_name[f"op {r.op}"]["found"] for r in OP_REGISTRATIONS)
    assert all(by_name[f"model {m.architecture}"]["found"] for m in SUPPORTED_MODELS)
    assert "linear-attention hybrid" in by_name["model BailingMoeV2_5ForCausalLM"]["notes"][0]


def test_table_output_names_sites_and_version(ascend_sdist: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["doctor", "--vllm-ascend", str(ascend_sdist)])
    out = capsys.readouterr().out
    for column in ("site", "found", "signature ok", "version"):
        assert column in out
    assert "a3.moe_dispatch" in out and REFERENCE_VLLM_ASCEND_VERSION in out
    if STATE_GAPS:
        assert code == 1
        summary = out[out.index(f"doctor: {len(STATE_GAPS)} of"):]
        assert all(gap in summary for gap in STATE_GAPS)
    else:
        assert code == 0
        assert "hook sites and symbols found" in out


def test_tree_and_sdist_give_the_same_answer(ascend_sdist: Path, ascend_tree: Path) -> None:
    a = open_source(ascend_sdist, "vllm_ascend")
    b = open_source(ascend_tree, "vllm_ascend")
    try:
        ra = [(r.name, r.found, r.signature_ok, r.line) for r in doctor.check_symbols(a, None)]
        rb = [(r.name, r.found, r.signature_ok, r.line) for r in doctor.check_symbols(b, None)]
    finally:
        a.close()
        b.close()
    assert ra == rb
    assert b.version == REFERENCE_VLLM_ASCEND_VERSION


def _edit(path: Path, old: str, new: str, *, occurrence: int) -> None:
    text = path.read_text()
    parts = text.split(old)
    assert len(parts) > occurrence, f"{old!r} occurs {len(parts) - 1} times in {path}"
    path.write_text(old.join(parts[:occurrence]) + new + old.join(parts[occurrence:]))


def test_renamed_site_is_named(ascend_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    copy = tmp_path / "renamed"
    shutil.copytree(ascend_tree, copy)
    dispatcher = copy / "vllm_ascend/ops/fused_moe/token_dispatcher.py"
    # The 4th `def token_dispatch(` is TokenDispatcherWithAll2AllV's (base, MC2, AllGather come first).
    text = dispatcher.read_text()
    cls_at = text.index("class TokenDispatcherWithAll2AllV")
    def_at = text.index("def token_dispatch(", cls_at)
    dispatcher.write_text(text[:def_at] + "def token_dispatch_v2(" + text[def_at + len("def token_dispatch("):])

    code = cli_main(["doctor", "--vllm-ascend", str(copy)])
    out = capsys.readouterr().out
    assert code == 1
    summary = out[out.index(f"doctor: {1 + len(STATE_GAPS)} of"):]
    assert "a3.moe_dispatch" in summary
    assert "TokenDispatcherWithAll2AllV.token_dispatch not found" in summary
    assert "token_dispatch_v2" in summary  # the hint lists what the class has now
    assert "a3.moe_combine" not in summary


def test_changed_signature_is_reported(ascend_tree: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    copy = tmp_path / "sig"
    shutil.copytree(ascend_tree, copy)
    pf = copy / "vllm_ascend/ops/fused_moe/prepare_finalize.py"
    text = pf.read_text()
    cls_at = text.index("class PrepareAndFinalizeWithAllGather")
    prep_at = text.index("def prepare(", cls_at)
    arg_at = text.index("router_logits", prep_at)
    pf.write_text(text[:arg_at] + "gate_logits" + text[arg_at + len("router_logits"):])

    code, payload = _run_json(capsys, "--vllm-ascend", str(copy))
    assert code == 1
    row = {r["name"]: r for r in payload["results"]}["a2.moe_prepare"]
    assert row["found"] is True and row["signature_ok"] is False
    assert "missing router_logits" in " ".join(row["problems"])
    assert [r["name"] for r in payload["results"] if not r["ok"] and r["name"] not in STATE_GAPS] == ["a2.moe_prepare"]


@pytest.mark.parametrize("kind", ["empty-dir", "text-file", "missing", "other-wheel"])
def test_not_a_vllm_ascend_source_exits_2(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          vllm_wheel: Path) -> None:

    target = {
        "empty-dir": tmp_path,
        "text-file": tmp_path / "notes.txt",
        "missing": tmp_path / "nope.tar.gz",
        "other-wheel": vllm_wheel,
    }[kind]
    if kind == "text-file":
        target.write_text("hello")
    code = cli_main(["doctor", "--vllm-ascend", str(target)])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert str(target) in lines[0] and "vllm_ascend source tree, sdist (.tar.gz) or wheel (.whl)" in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


def test_no_argument_checks_installed_package_without_importing(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util
    import sys

    code = cli_main(["doctor"])
    captured = capsys.readouterr()
    if importlib.util.find_spec("vllm_ascend") is None:
        assert code == 2
        assert "vllm_ascend is not installed" in captured.err
    else:  # pragma: no cover - only on an Ascend host
        assert code in (0, 1)
    assert "vllm_ascend" not in sys.modules and "torch_npu" not in sys.modules


def _rows_after(ascend_tree: Path, tmp_path: Path, edits: list[tuple[str, str, str, int]], **kwargs: object
                ) -> dict[str, doctor.SiteCheck]:
    """Every row of the doctor on a copy of the release with ``edits`` (relpath, old, new, occurrence; 0: every
    occurrence) applied."""
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(ascend_tree, copy)
    for relpath, old, new, occurrence in edits:
        if occurrence == 0:
            text = (copy / relpath).read_text()
            assert old in text, f"{old!r} not in {relpath}"
            (copy / relpath).write_text(text.replace(old, new))
        else:
            _edit(copy / relpath, old, new, occurrence=occurrence)
    src = open_source(copy, "vllm_ascend")
    try:
        return {r.name: r for r in doctor.check_symbols(src, None, **kwargs)}  # type: ignore[arg-type]
    finally:
        src.close()


def _problems_after(ascend_tree: Path, tmp_path: Path, relpath: str, old: str, new: str, occurrence: int = 1
                    ) -> dict[str, list[str]]:
    """The rows with problems after one edit (the known PER_UBATCH_STATE gaps left out: see STATE_GAPS)."""
    rows = _rows_after(ascend_tree, tmp_path, [(relpath, old, new, occurrence)])
    return {name: r.problems for name, r in rows.items() if r.problems and name not in STATE_GAPS}


def test_a_changed_decorator_is_named(ascend_tree: Path, tmp_path: Path) -> None:
    """_dummy_run is wrapped as written for @torch.inference_mode(); a release that drops or swaps it changes how
    the wrapped method runs (a green doctor must mean the plugin will run)."""
    problems = _problems_after(ascend_tree, tmp_path, "vllm_ascend/worker/model_runner_v1.py",
                               "    @torch.inference_mode()\n    def _dummy_run(", "    def _dummy_run(")
    assert list(problems) == ["runner.dummy_run"]
    assert "decorators of NPUModelRunner._dummy_run changed" in problems["runner.dummy_run"][0]
    assert "@torch.inference_mode, has none" in problems["runner.dummy_run"][0]


def test_a_custom_op_that_stops_calling_its_routed_collective_is_named(ascend_tree: Path, tmp_path: Path) -> None:
    problems = _problems_after(ascend_tree, tmp_path, "vllm_ascend/ops/register_custom_ops.py",
                               "tensor_model_parallel_all_gather(x, 0)", "torch.ops.vllm.some_gather(x, 0)")
    assert list(problems) == ["fc1.all_gather"]
    assert "no longer calls tensor_model_parallel_all_gather from its module's globals" in problems["fc1.all_gather"][0]


def test_a_changed_op_registration_is_named(ascend_tree: Path, tmp_path: Path) -> None:
    problems = _problems_after(ascend_tree, tmp_path, "vllm_ascend/ops/register_custom_ops.py",
                               'op_func=_maybe_pad_and_reduce_impl,\n    fake_impl=_maybe_pad_and_reduce_fake,\n'
                               '    mutates_args=[],\n    dispatch_key="PrivateUse1"',
                               'op_func=_maybe_pad_and_reduce_impl,\n    fake_impl=_maybe_pad_and_reduce_fake,\n'
                               '    mutates_args=[],\n    dispatch_key="CPU"')
    assert list(problems) == ["op vllm::maybe_pad_and_reduce"]
    assert "dispatch key CPU, the runtime expects PrivateUse1" in problems["op vllm::maybe_pad_and_reduce"][0]


def test_builders_per_group_unknown_is_named(ascend_tree: Path, tmp_path: Path) -> None:
    problems = _problems_after(ascend_tree, tmp_path, "vllm_ascend/worker/model_runner_v1.py",
                               "def initialize_attn_backend(", "def initialize_attention_backends(")
    assert list(problems) == ["runner.builders_per_group"]
    assert "cannot tell how many metadata builders" in problems["runner.builders_per_group"][0]


def test_a_supported_model_that_became_stateful_is_named(vllm_wheel: Path, tmp_path: Path) -> None:
    import zipfile

    wanted = ("vllm/__init__.py", "vllm/model_executor/models/registry.py", "vllm/model_executor/models/qwen3_moe.py")
    with zipfile.ZipFile(vllm_wheel) as whl:
        for name in wanted:
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_bytes(whl.read(name))
    qwen3_moe = tmp_path / "vllm/model_executor/models/qwen3_moe.py"
    qwen3_moe.write_text(qwen3_moe.read_text().replace("class Qwen3MoeForCausalLM(", "class Qwen3MoeForCausalLM(IsHybrid, ", 1))
    src = open_source(tmp_path, "vllm")
    try:
        by_name = {r.name: r for r in doctor.check_supported_models(src, {})}
    finally:
        src.close()
    assert "declares IsHybrid" in by_name["model Qwen3MoeForCausalLM"].problems[0]
    # the other modules are absent from this partial tree: named as missing, never passed
    assert "not found" in by_name["model Qwen3ForCausalLM"].problems[0]


# ----------------------------------------------------------------------------------------------------------------
# The facts the DBO fixes rely on: each holds in 0.23.0.post1 and is named when a release changes it.
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torch_npu_host() -> dict[str, doctor.HostDist]:
    """The host pair read from the torch-npu 2.10.0.post4 wheel's METADATA (zipfile; never imported)."""
    import zipfile

    wheels = sorted(CACHE.glob("torch_npu-2.10.0.post4-*.whl"))
    if not wheels:
        pytest.skip(f"no torch_npu-2.10.0.post4-*.whl in {CACHE}")
    with zipfile.ZipFile(wheels[0]) as whl:
        (meta,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        lines = whl.read(meta).decode().split("\n\n", 1)[0].splitlines()
    version = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Version:"))
    requires = tuple(line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:"))
    torch_pin = next(r for r in requires if r.startswith("torch ") or r.startswith("torch="))
    return {"torch-npu": doctor.HostDist(version, requires),
            "torch": doctor.HostDist(torch_pin.split("==", 1)[1].strip())}


def test_facts_hold_in_the_real_release(ascend_sdist: Path) -> None:
    """Every fact row passes on 0.23.0.post1 with the table the runtime needs, and says what it found."""
    src = open_source(ascend_sdist, "vllm_ascend")
    try:
        rows = {r.name: r for r in doctor.check_symbols(src, None, per_ubatch_state=COMPLETE_STATE,
                                                        host=ASCEND_HOST)}
    finally:
        src.close()
    assert all(rows[name].ok and rows[name].found and not rows[name].warnings for name in FACT_ROWS), \
        {name: (rows[name].problems, rows[name].warnings) for name in FACT_ROWS}
    assert rows["attn_state.members"].notes == ["members: PrefillNoCache, PrefillCacheHit, DecodeOnly, ChunkedPrefill, "
                                                "SpecDecoding"]
    assert ("PrefillNoCache when `np.all(self.input_batch.num_computed_tokens_cpu[:num_reqs] == 0)` "
            "(vllm_ascend/worker/model_runner_v1.py:1478)") in rows["attn_state.rule"].notes
    assert "no KV cache read (vllm_ascend/attention/attention_v1.py:1194)" in rows["attn_state.prefill_no_cache"].notes[0]
    assert "views of the globals _cos_mla, _sin_mla" in rows["rotary.mla_buffer"].notes[0]
    assert rows["rotary.caller AscendMLAMetadataBuilder"].notes == [
        "calls get_cos_and_sin_mla(use_cache=True) at vllm_ascend/attention/mla_v1.py:656"]
    assert rows["rotary.caller AscendSFAMetadataBuilder"].notes == [
        "calls get_cos_and_sin_mla(use_cache=draft_index is None) at vllm_ascend/attention/sfa_v1.py:392"]
    assert "'hccl' (vllm_ascend/worker/worker.py:992 in NPUWorker._init_worker_distributed_environment)" in \
        rows["dist.default_backend"].notes[0]
    assert rows["runner.model_forward_parts"].notes == [
        "redone per micro-batch by forward_ubatch: the model call (vllm_ascend/worker/model_runner_v1.py:2854) and "
        "_all_gather_hidden_states_and_aux when `forward_context.flash_comm_v1_enabled and (not isinstance("
        "hidden_states, IntermediateTensors))` (vllm_ascend/worker/model_runner_v1.py:2873); left out (graph replay): "
        "_update_full_graph_params_if_needed (vllm_ascend/worker/model_runner_v1.py:2858, :2868) and synchronize() "
        "under PIECEWISE (vllm_ascend/worker/model_runner_v1.py:2866)",
        "NPUModelRunner._all_gather_hidden_states_and_aux at vllm_ascend/worker/model_runner_v1.py:2801 "
        "(staticmethod)"]
    call = rows["forward_context.ascend_call"]
    assert re.fullmatch(
        r"AscendIntegration\.ascend_context \(dbo_runtime/ascend/runner\.py:\d+\) passes attn_metadata, vllm_config "
        r"positionally and num_tokens, .*, has_sinks, input_ids, eplb_heat_collection_status by name: all parameters "
        r"of set_ascend_forward_context \(vllm_ascend/ascend_forward_context\.py:58\)", call.notes[0]), call.notes
    # the one parameter execute_model passes and the micro-batches leave at its default, on purpose
    assert call.notes[1] == ("NPUModelRunner.execute_model (vllm_ascend/worker/model_runner_v1.py:2296) passes "
                             "max_tokens_across_pcp; AscendIntegration.ascend_context leaves it at 0: the runner passes "
                             "0 unless prefill_context_parallel_size > 1, which validate refuses with DBO")
    assert rows["host.torch_pair"].notes[0] == ("vllm-ascend 0.23.0.post1 pins torch==2.10.0, torch-npu==2.10.0.post4 "
                                                "(requirements.txt)")


def test_prepare_finalize_state_is_derived_from_the_source(ascend_sdist: Path) -> None:
    """The attributes prepare stores and finalize reads (through the helpers they call) are derived with ast; the
    runtime's table covers the A2 class, and a class it does not cover is an error naming the attributes."""
    src = open_source(ascend_sdist, "vllm_ascend")
    try:
        rows = {r.name: r for r in doctor.check_ubatch_state(src, {}, PER_UBATCH_STATE)}
        bare = {r.name: r for r in doctor.check_ubatch_state(src, {}, {})}
        short = {k: tuple(a for a in v if a != "replace_allreduce") for k, v in COMPLETE_STATE.items()}
        lacking = {r.name: r for r in doctor.check_ubatch_state(src, {}, short)}
    finally:
        src.close()
    for cls, carried in CARRIED_0_23.items():
        row = rows[f"ubatch_state {cls}"]
        assert row.found and row.notes[0].startswith("prepare stores for finalize, in "
                                                     "vllm_ascend/ops/fused_moe/prepare_finalize.py: ")
        assert [part.split(" (", 1)[0] for part in row.notes[0].split(": ", 1)[1].split("), ")] == list(carried)
        # no table at all: every carried attribute named
        (problem,) = bare[f"ubatch_state {cls}"].problems
        assert f"has no {' / '.join(doctor.state_keys(next(f for f in UBATCH_STATE_FACTS if f.cls == cls)))}" in problem
        assert f"prepare stores {', '.join(carried)} that finalize reads" in problem
    assert rows["ubatch_state PrepareAndFinalizeWithAllGather"].ok  # PER_UBATCH_STATE's A2 entries
    assert set(STATE_GAPS) == {f"ubatch_state {f.cls}" for f in UBATCH_STATE_FACTS if not rows[f"ubatch_state {f.cls}"].ok}
    for gap in STATE_GAPS:
        assert "replace_allreduce" in rows[gap].problems[0]
    # a table entry that lacks one attribute: named with the lines where it is set and read
    problems = lacking["ubatch_state PrepareAndFinalizeWithAll2All"].problems
    assert len(problems) == 2 and all("does not keep replace_allreduce" in p for p in problems)
    assert "(vllm_ascend/ops/fused_moe/prepare_finalize.py:151 -> :208)" in problems[0]
    assert lacking["ubatch_state PrepareAndFinalizeWithAllGather"].ok


_PF = "vllm_ascend/ops/fused_moe/prepare_finalize.py"
_MR = "vllm_ascend/worker/model_runner_v1.py"
_ATT = "vllm_ascend/attention/attention_v1.py"


@pytest.mark.parametrize(("row", "edits", "expected"), [
    ("attn_state.rule", [(_MR, "def _build_attn_state(", "def _decide_attn_state(", 1)],
     "NPUModelRunner._build_attn_state not found in vllm_ascend/worker/model_runner_v1.py: where the batch's "
     "attn_state is decided has changed"),
    ("attn_state.rule", [(_MR, "np.all(self.input_batch.num_computed_tokens_cpu[:num_reqs] == 0)",
                          "np.all(num_scheduled_tokens > 1)", 1)],
     "NPUModelRunner._build_attn_state (vllm_ascend/worker/model_runner_v1.py:1478) sets PrefillNoCache when "
     "`np.all(num_scheduled_tokens > 1)`, no longer when no request has computed tokens"),
    ("attn_state.members", [(_ATT, "    SpecDecoding = 4\n", "    SpecDecode = 4\n", 1)],
     "AscendAttentionState (vllm_ascend/attention/attention_v1.py:147) no longer has SpecDecoding"),
    ("attn_state.prefill_no_cache", [(_ATT, "            block_table = None\n",
                                      "            block_table = attn_metadata.block_tables\n", 1)],
     "in PrefillNoCache, AscendAttentionBackendImpl._get_fia_params (vllm_ascend/attention/attention_v1.py:1194) now "
     "reads block_tables"),
    ("rotary.mla_buffer", [("vllm_ascend/ops/rotary_embedding.py", "_cos_mla", "_cos_mla_buf", 0)],
     "vllm_ascend/ops/rotary_embedding.py has no module global _cos_mla"),
    ("rotary.caller AscendSFAMetadataBuilder",
     [("vllm_ascend/attention/sfa_v1.py", "get_cos_and_sin_mla(input_positions", "get_cos_and_sin(input_positions",
       1)],
     "AscendSFAMetadataBuilder (vllm_ascend/attention/sfa_v1.py) no longer calls get_cos_and_sin_mla"),
    ("ubatch_state PrepareAndFinalizeWithAllGather",
     [(_PF, "        self.enable_shared_expert_dp = enable_shared_expert_dp\n",
       "        self.enable_shared_expert_dp = enable_shared_expert_dp\n        self.local_tokens = hidden_states.shape[0]\n",
       3),
      (_PF, "hidden_states = hidden_states[: self.num_tokens]\n",
       "hidden_states = hidden_states[: min(self.num_tokens, self.local_tokens)]\n", 2)],
     "PER_UBATCH_STATE['a2.moe_prepare'] does not keep local_tokens, which PrepareAndFinalizeWithAllGather.prepare "
     "stores and PrepareAndFinalizeWithAllGather.finalize reads (vllm_ascend/ops/fused_moe/prepare_finalize.py:446 ->"
     " :544)"),
    ("dist.default_backend", [("vllm_ascend/worker/worker.py", 'self.local_rank, "hccl"', 'self.local_rank, "gloo"', 1)],
     "the default process group's backend changed to 'gloo' (vllm_ascend/worker/worker.py:992 in "
     "NPUWorker._init_worker_distributed_environment), was 'hccl'"),
    ("runner.model_forward_parts",
     [(_MR, "            hidden_states = self._all_gather_hidden_states_and_aux(hidden_states)\n        return hidden_states\n",
       "            hidden_states = self._all_gather_hidden_states_and_aux(hidden_states)\n        self._new_step()\n"
       "        return hidden_states\n", 1)],
     "NPUModelRunner._model_forward (vllm_ascend/worker/model_runner_v1.py:2834) calls self._new_step "
     "(vllm_ascend/worker/model_runner_v1.py:2874), a step the runtime's replacement for a split step's micro-batches "
     "(AscendIntegration.forward_ubatch) does not take"),
    ("runner.model_forward_parts",
     [(_MR, "        if forward_context.flash_comm_v1_enabled and not isinstance(hidden_states, IntermediateTensors):\n"
            "            hidden_states = self._all_gather_hidden_states_and_aux(hidden_states)\n",
       "        hidden_states = self._all_gather_hidden_states_and_aux(hidden_states)\n", 1)],
     "calls self._all_gather_hidden_states_and_aux (vllm_ascend/worker/model_runner_v1.py:2872) other than under a "
     "flash_comm_v1_enabled test"),
    ("runner.model_forward_parts",
     [(_MR, "            hidden_states = run_model()\n        else:",
       "            torch.npu.current_stream().synchronize()\n            hidden_states = run_model()\n        else:", 1)],
     "calls torch.npu.current_stream().synchronize() outside CUDAGraphMode.PIECEWISE "
     "(vllm_ascend/worker/model_runner_v1.py:2861)"),
    ("runner.model_forward_parts",
     [(_MR, '"inputs_embeds": inputs_embeds,', '"inputs_embeds": inputs_embeds,\n            "sampling_metadata": None,', 1)],
     "NPUModelRunner._model_forward (vllm_ascend/worker/model_runner_v1.py:2834) now gives the model "
     "sampling_metadata (partial(self.model...) at vllm_ascend/worker/model_runner_v1.py:2855), which forward_ubatch "
     "does not pass"),
    ("runner.model_forward_parts",
     [(_MR, "def _all_gather_hidden_states_and_aux(", "def _all_gather_hidden_states_with_aux(", 1)],
     "NPUModelRunner (vllm_ascend/worker/model_runner_v1.py) has no _all_gather_hidden_states_and_aux, which "
     "forward_ubatch calls on the runner"),
    ("forward_context.ascend_call",
     [("vllm_ascend/ascend_forward_context.py", "    attn_metadata: Any,\n    vllm_config: VllmConfig,\n",
       "    attn_metadata: Any,\n    vllm_config: VllmConfig,\n    step_id: int,\n", 1)],
     "set_ascend_forward_context (vllm_ascend/ascend_forward_context.py:58) has parameter(s) without a default that "
     "AscendIntegration.ascend_context"),
    ("forward_context.ascend_call",
     [("vllm_ascend/ascend_forward_context.py", "    attn_metadata: Any,\n", "    layer_name: str,\n    attn_metadata: Any,\n",
       1)],
     "the first parameters of set_ascend_forward_context (vllm_ascend/ascend_forward_context.py:58) are now "
     "layer_name, attn_metadata;"),
], ids=["rule-removed", "rule-changed", "enum-member", "no-cache-reads-cache", "rotary-global-renamed",
        "builder-stops-calling", "finalize-reads-new-attr", "backend-gloo", "model-forward-new-step",
        "gather-unguarded", "sync-outside-piecewise", "model-gets-new-input", "gather-method-renamed",
        "forward-context-required-param", "forward-context-positional-shift"])
def test_a_changed_fact_is_named(row: str, edits: list[tuple[str, str, str, int]], expected: str, ascend_tree: Path,
                                 tmp_path: Path) -> None:
    rows = _rows_after(ascend_tree, tmp_path, edits, per_ubatch_state=COMPLETE_STATE, host=ASCEND_HOST)
    failing = sorted(name for name, r in rows.items() if not r.ok)
    assert failing == [row], {name: rows[name].problems for name in failing}
    assert rows[row].signature_ok is not True
    assert any(expected in p for p in rows[row].problems), rows[row].problems


def test_the_rotary_rename_names_the_new_global(ascend_tree: Path, tmp_path: Path) -> None:
    rows = _rows_after(ascend_tree, tmp_path, [("vllm_ascend/ops/rotary_embedding.py", "_cos_mla", "_cos_mla_buf", 0)],
                       per_ubatch_state=COMPLETE_STATE)
    assert rows["rotary.mla_buffer"].problems[-1].endswith("; it now writes _cos_mla_buf")


def test_the_torch_pair_is_compared_and_a_mismatch_only_warns(ascend_tree: Path, tmp_path: Path,
                                                             torch_npu_host: dict[str, doctor.HostDist]) -> None:
    """The pair 0.23.0.post1 pins is the pair the torch-npu wheel makes (it requires torch==2.10.0+cpu): no warning.
    This machine's kind of host (torch 2.13.0+cpu, no torch-npu) and a release that pins another torch-npu warn,
    naming both pairs, and the row still passes."""
    src = open_source(ascend_tree, "vllm_ascend")
    try:
        good = doctor.check_torch_pair(src, torch_npu_host)
        cpu_host = doctor.check_torch_pair(src, {"torch": doctor.HostDist("2.13.0+cpu"),
                                                 "torch-npu": doctor.HostDist(None)})
    finally:
        src.close()
    assert good.ok and good.found and not good.warnings, good.warnings
    assert "torch-npu 2.10.0.post4 requires torch==2.10.0+cpu" in good.notes
    assert cpu_host.ok and cpu_host.warnings == [
        "the host's pair (torch 2.13.0+cpu, torch-npu not installed) is not the pair vllm-ascend 0.23.0.post1 pins "
        "(torch==2.10.0, torch-npu==2.10.0.post4, requirements.txt)"]
    rows = _rows_after(ascend_tree, tmp_path, [("requirements.txt", "torch-npu==2.10.0.post4", "torch-npu==2.11.0", 1)],
                       per_ubatch_state=COMPLETE_STATE, host=torch_npu_host)
    pair = rows["host.torch_pair"]
    assert pair.ok and not [name for name, r in rows.items() if not r.ok]
    assert ("the host's pair (torch 2.10.0+cpu, torch-npu 2.10.0.post4) is not the pair vllm-ascend 0.23.0.post1 pins "
            "(torch==2.10.0, torch-npu==2.11.0, requirements.txt)") in pair.warnings
    assert "PKG-INFO pins torch-npu==2.10.0.post4, requirements.txt torch-npu==2.11.0" in pair.warnings


def test_a_warning_is_shown_but_does_not_fail(ascend_sdist: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "host_versions", lambda names=(): {"torch": doctor.HostDist("2.13.0+cpu"),
                                                                   "torch-npu": doctor.HostDist(None)})
    monkeypatch.setattr(doctor, "_per_ubatch_state_table", lambda: COMPLETE_STATE)
    code = cli_main(["doctor", "--vllm-ascend", str(ascend_sdist)])
    out = capsys.readouterr().out
    assert code == 0
    assert ("doctor: warning: host.torch_pair: the host's pair (torch 2.13.0+cpu, torch-npu not installed) is not the "
            "pair vllm-ascend 0.23.0.post1 pins") in out


def test_a_forward_context_parameter_the_runtime_passes_is_named_when_gone(ascend_tree: Path, tmp_path: Path) -> None:
    """set_ascend_forward_context without has_sinks: ascend_context's call would raise TypeError on the first split
    step. Named by the call check (keywords read from runner.py) and by the parameter table of the symbol row."""
    rows = _rows_after(ascend_tree, tmp_path, [("vllm_ascend/ascend_forward_context.py", "    has_sinks=False,\n", "", 1)],
                       per_ubatch_state=COMPLETE_STATE, host=ASCEND_HOST)
    failing = sorted(name for name, r in rows.items() if not r.ok)
    assert failing == ["forward_context.ascend", "forward_context.ascend_call"], failing
    (problem,) = rows["forward_context.ascend_call"].problems
    assert re.fullmatch(r"AscendIntegration\.ascend_context \(dbo_runtime/ascend/runner\.py:\d+\) passes has_sinks, "
                        r"which set_ascend_forward_context \(vllm_ascend/ascend_forward_context\.py:58\) does not take "
                        r"\(has: .*\)", problem), problem
    assert "missing has_sinks" in rows["forward_context.ascend"].problems[0]


def test_what_the_runner_passes_and_the_runtime_does_not_warns(ascend_tree: Path, tmp_path: Path) -> None:
    """execute_model passing a parameter ascend_context leaves out is a warning naming it (the row still passes), and
    so is a changed default of the one the table leaves at its default on purpose."""
    rows = _rows_after(ascend_tree, tmp_path, [
        (_MR, "skip_compiled=has_encoder_input,", "skip_compiled=has_encoder_input,\n                draft_attn_metadatas=None,", 1),
        ("vllm_ascend/ascend_forward_context.py", "max_tokens_across_pcp: int = 0,", "max_tokens_across_pcp: int = 1,", 1),
    ], per_ubatch_state=COMPLETE_STATE, host=ASCEND_HOST)
    assert not [name for name, r in rows.items() if not r.ok]
    row = rows["forward_context.ascend_call"]
    assert len(row.warnings) == 2, row.warnings
    assert row.warnings[0].startswith("NPUModelRunner.execute_model (vllm_ascend/worker/model_runner_v1.py:2296) passes "
                                      "draft_attn_metadatas to set_ascend_forward_context, "
                                      "AscendIntegration.ascend_context (dbo_runtime/ascend/runner.py:")
    assert row.warnings[0].endswith("does not: the micro-batches' forward contexts get the default")
    assert "leaves at its default, now 1 in set_ascend_forward_context" in row.warnings[1]
    assert "(was 0: the runner passes 0 unless prefill_context_parallel_size > 1" in row.warnings[1]


def test_a_keyword_of_the_runtime_that_the_release_lacks_is_named(ascend_sdist: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The keywords are read from the runtime's source (runner.py), not from a list: a keyword ascend_context starts
    passing that the release does not take fails the row."""
    path, text = runtime_source(FORWARD_CONTEXT_CALL.runtime_module) or ("", "")
    assert "has_sinks=bool(" in text
    monkeypatch.setattr(doctor, "runtime_source", lambda module: (path, text.replace("has_sinks=bool(", "sinks=bool(")))
    src = open_source(ascend_sdist, "vllm_ascend")
    try:
        row = doctor.check_forward_context_call(src, {})
    finally:
        src.close()
    assert not row.ok and row.found
    assert "passes sinks, which set_ascend_forward_context (vllm_ascend/ascend_forward_context.py:58) does not take" \
        in row.problems[0]


def test_the_parameter_table_lists_what_the_runtime_passes() -> None:
    """The PATCHED_SYMBOLS row of set_ascend_forward_context lists every parameter ascend_context passes (its two
    positional arguments first), so that the symbol check and the install-time view of it cover the same names."""
    import ast

    path, text = runtime_source(FORWARD_CONTEXT_CALL.runtime_module) or ("", "")
    calls = [c for c in ast.walk(ast.parse(text)) if isinstance(c, ast.Call)
             and getattr(c.func, "id", None) == FORWARD_CONTEXT_CALL.function]
    assert len(calls) == 1, path
    table = next(p.params for p in PATCHED_SYMBOLS if p.name == FORWARD_CONTEXT_CALL.table)
    assert table[:len(calls[0].args)] == ("attn_metadata", "vllm_config")
    assert {k.arg for k in calls[0].keywords} <= set(table)
