"""`dbo-runtime doctor` against the real vllm-ascend 0.23.0.post1 sdist and vLLM 0.23.0 wheel from PyPI.

The archives are downloaded once with pip (no install, no dependencies) into <repo>/.cache/dbo-runtime/, which git
ignores; a failed download fails these tests and says why.
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import pytest
from dbo_runtime.ascend import doctor
from dbo_runtime.ascend.sites import (
    OP_REGISTRATIONS,
    PATCHED_SYMBOLS,
    REFUSED_MODELS,
    SITES,
    SUPPORTED_MODELS,
    VLLM_SYMBOLS,
)
from dbo_runtime.ascend.source import (
    REFERENCE_VLLM_ASCEND_VERSION,
    REFERENCE_VLLM_VERSION,
    download_release,
    open_source,
)
from dbo_runtime.cli import main as cli_main
from dbo_runtime.errors import DBOConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]
CACHE = REPO_ROOT / ".cache" / "dbo-runtime"


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
    with tarfile.open(ascend_sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.isfile() and (m.name.split("/")[1:2] == ["vllm_ascend"] or m.name.endswith("/PKG-INFO"))
                   and m.name.endswith((".py", "PKG-INFO"))]
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
    bad = [r for r in payload["results"] if not r["ok"]]
    assert code == 0, bad
    assert payload["vllm_ascend"]["version"] == REFERENCE_VLLM_ASCEND_VERSION
    assert payload["vllm"]["version"] == REFERENCE_VLLM_VERSION
    names = {r["name"] for r in payload["results"]}
    assert names == ({s.name for s in (*SITES, *PATCHED_SYMBOLS, *VLLM_SYMBOLS)} | {f"op {r.op}" for r in OP_REGISTRATIONS}
                     | {f"model {m.architecture}" for m in SUPPORTED_MODELS} | {f"model {a}" for a in REFUSED_MODELS}
                     | {"runner.builders_per_group"})
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
    assert code == 0
    for column in ("site", "found", "signature ok", "version"):
        assert column in out
    assert "a3.moe_dispatch" in out and REFERENCE_VLLM_ASCEND_VERSION in out
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
    summary = out[out.index("doctor: 1 of"):]
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
    assert [r["name"] for r in payload["results"] if not r["ok"]] == ["a2.moe_prepare"]


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


def _problems_after(ascend_tree: Path, tmp_path: Path, relpath: str, old: str, new: str, occurrence: int = 1
                    ) -> dict[str, list[str]]:
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(ascend_tree, copy)
    _edit(copy / relpath, old, new, occurrence=occurrence)
    src = open_source(copy, "vllm_ascend")
    try:
        return {r.name: r.problems for r in doctor.check_symbols(src, None) if r.problems}
    finally:
        src.close()


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
