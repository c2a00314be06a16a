"""Property-based fuzzing (hypothesis) of dbo-runtime's inputs: collect results given to `compare diff`, the
gates, and the numbers of `reference` and `compare run`. The promise under test: the command exits 0 or 1 with
a verdict, or 2 with exactly one line on stderr and nothing written; never a traceback. Nothing here starts a
vLLM engine or a rank: every bad value must be refused before that (a good one would start one, so the numbers
are drawn outside the accepted ranges, or the run is cut off by an unwritable output first). A few seconds in
all (derandomized, no database)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from dbo_runtime.cli import main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
# Results that look like collect output, with any field possibly wrong.
result_item = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(max_size=6), json_value), "text": st.one_of(st.text(max_size=6), json_value),
     "tokens": st.one_of(st.lists(st.one_of(st.integers(0, 50), st.text(max_size=3)), max_size=5), json_value),
     "logprobs": st.one_of(st.lists(st.one_of(st.floats(max_value=0.0), st.none(), st.text(max_size=2)), max_size=5),
                           json_value)})
collect_like = st.one_of(json_value, st.fixed_dictionaries({"results": st.one_of(st.lists(result_item, max_size=4),
                                                                                 json_value)}))


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, list[str]]:
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, [line for line in captured.err.splitlines() if line.strip()]


@FUZZ
@given(a=collect_like, b=collect_like)
def test_diff_of_any_json_gives_a_verdict_or_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     a: object, b: object) -> None:
    pa, pb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out" / "diff.json"
    out.parent.mkdir(exist_ok=True)
    out.unlink(missing_ok=True)
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    code, err = _run(capsys, ["compare", "diff", str(pa), str(pb), "--format", "json", "-o", str(out)])
    assert code in (0, 1, 2)
    if code == 2:
        assert len(err) == 1 and not out.exists()
    else:
        report = json.loads(out.read_text())
        assert report["prompts"] > 0 and 0 <= report["identical"] <= report["prompts"]
        # an identity resting on no token compared is refused, never reported
        assert report["identical"] == 0 or report["compared_tokens"] > 0, report


non_finite = st.sampled_from([math.nan, math.inf, -math.inf])


@FUZZ
@given(logprobs=st.lists(st.floats(max_value=0.0, allow_infinity=False), min_size=1, max_size=4), at=st.integers(0, 3),
       bad=non_finite)
def test_diff_refuses_non_finite_logprobs(tmp_path: Path, capsys: pytest.CaptureFixture[str], logprobs: list[float],
                                          at: int, bad: float) -> None:
    good = {"results": [{"prompt": "p", "text": "x", "tokens": list(range(len(logprobs))), "logprobs": logprobs}]}
    broken = json.loads(json.dumps(good))
    broken["results"][0]["logprobs"][at % len(logprobs)] = bad
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(good))
    pb.write_text(json.dumps(broken))  # NaN/Infinity literals, as Python's json writes them
    code, err = _run(capsys, ["compare", "diff", str(pa), str(pb)])
    assert code == 2 and len(err) == 1 and "not a finite number" in err[0], err


gate = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                 st.integers(min_value=-(10**20), max_value=10**20))


@FUZZ
@given(min_identical=gate, max_diff=gate)
def test_diff_gates_are_a_number_that_can_pass_or_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           min_identical: object, max_diff: object) -> None:
    doc = {"results": [{"prompt": "p", "text": "x", "tokens": [1], "logprobs": [-0.5]}]}
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(doc))
    pb.write_text(json.dumps(doc))
    code, err = _run(capsys, ["compare", "diff", str(pa), str(pb), "--min-identical", str(min_identical),
                              "--max-logprob-diff", str(max_diff)])
    try:
        lo, hi = float(str(min_identical)), float(str(max_diff))
    except ValueError:
        lo = hi = math.nan
    can_pass = 0.0 <= lo <= 1.0 and hi >= 0.0 and not math.isnan(hi)
    if not can_pass:
        assert code == 2 and len(err) == 1, (min_identical, max_diff, err)
    else:
        assert code == 0  # identical runs pass every gate that can pass


bad_count = st.one_of(st.integers(max_value=0), st.integers(min_value=10**7, max_value=10**40),
                      st.text(alphabet="-x.e ", min_size=1, max_size=6), st.floats(allow_nan=True).map(str))


@FUZZ
@given(option=st.sampled_from(["--tensor-parallel-size", "--num-prompts", "--max-tokens"]), value=bad_count)
def test_compare_run_refuses_bad_numbers_before_any_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           option: str, value: object) -> None:
    code, err = _run(capsys, ["compare", "run", "--model", str(tmp_path), "--vllm-python", "/bin/false",
                              option, str(value)])
    assert code == 2 and len(err) == 1, err


@FUZZ
@given(option=st.sampled_from(["--tokens", "--layers", "--ranks", "--steps", "--hidden", "--experts"]), value=bad_count)
def test_reference_refuses_bad_numbers_before_any_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       option: str, value: object) -> None:
    out = tmp_path / "ref.json"
    code, err = _run(capsys, ["reference", option, str(value), "-o", str(out)])
    assert code == 2 and len(err) == 1 and not out.exists(), err


link_latency = st.one_of(st.floats(min_value=10_000.0, exclude_min=True), st.floats(max_value=0.0, exclude_max=True),
                         st.just(math.nan))
link_gbps = st.one_of(st.floats(min_value=0.0, max_value=1e-3, exclude_max=True),
                      st.floats(min_value=1e4, exclude_min=True, allow_infinity=False),
                      st.floats(max_value=0.0), st.just(math.nan))


@FUZZ
@given(latency=st.one_of(link_latency, st.floats(0.0, 10_000.0)), gbps=link_gbps, which=st.booleans())
def test_reference_refuses_a_link_outside_the_physical_range(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            latency: float, gbps: float, which: bool) -> None:
    from dbo_runtime.reference.comm import LinkModel

    if which:  # the bad value in either place
        latency, gbps = (latency if not 0.0 <= latency <= 10_000.0 else 1e5), min(max(gbps, 1e-3), 1e4)
    out = tmp_path / "ref.json"
    code, err = _run(capsys, ["reference", "--link", f"{latency!r},{gbps!r}", "-o", str(out)])
    assert code == 2 and len(err) == 1 and "--link" in err[0] and not out.exists(), (latency, gbps, err)
    with pytest.raises(Exception, match="out of range|invalid"):
        LinkModel.parse(f"{latency!r},{gbps!r}")


@pytest.fixture(scope="module")
def hardware_doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("hw") / "estimate.json"
    assert main(["estimate", "--model", "qwen3-30b-a3b", "--tokens", "64", "--format", "json", "-o", str(path)]) == 0
    return json.loads(path.read_text())["hardware"]


measured_like = st.one_of(json_value, st.fixed_dictionaries(
    {"gflops": json_leaf, "copy_gbps": json_leaf, "shape": json_leaf},
    optional={"op_us": json_leaf, "gflops_by_rows": json_value}))


@FUZZ
@given(measured=measured_like)
def test_estimate_hardware_measured_section_gives_an_estimate_or_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], hardware_doc: dict, measured: object) -> None:
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(dict(hardware_doc, measured=measured)))
    capsys.readouterr()
    code, err = _run(capsys, ["estimate", "--model", "qwen3-30b-a3b", "--tokens", "64", "--hardware-file", str(path)])
    assert code in (0, 2), err
    if code == 2:
        assert len(err) == 1 and "measured" in err[0], err
