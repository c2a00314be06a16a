"""``compare run --control-if-differ``: the control (DBO off twice) runs only when DBO on differs from off.

The engine runs are replaced by recorded outputs (``_run_one`` is what starts a vLLM; the real-engine test of
``compare run`` is test_vllm_dbo.py): this checks which runs happen and what the report says, not vLLM.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dbo_runtime.vllm import compare


def _result(texts: list[str]) -> dict:
    return {"results": [{"prompt": f"p{i}", "text": t, "tokens": [i, len(t)], "logprobs": [-0.5, -1.0]}
                        for i, t in enumerate(texts)]}


@pytest.mark.parametrize("on_texts, runs, control", [
    (["a", "b"], ["off", "on"], "skipped: DBO on equals off"),
    (["a", "c"], ["off", "on", "off-control"], "ran"),
])
def test_control_runs_only_when_on_differs(tmp_path: Path, monkeypatch, on_texts, runs, control) -> None:
    seen: list[str] = []

    def fake_run_one(python, model, dbo, workdir, *, label="", **kw):
        label = label or ("on" if dbo else "off")
        seen.append(label)
        out = _result(on_texts if dbo else ["a", "b"])
        return out, [{"split_steps": 3, "steps": 4}], _log(tmp_path)

    monkeypatch.setattr(compare, "_run_one", fake_run_one)
    report = compare.run_compare(str(tmp_path), python="python", control="if-differ", workdir=tmp_path / "w")
    assert seen == runs
    assert report["control"] == control
    assert ("control_identical_pct" in report) == (control == "ran")
    always = compare.run_compare(str(tmp_path), python="python", control="always", workdir=tmp_path / "w")
    assert always["control"] == "ran" and seen[-3:] == ["off", "off-control", "on"]
    with pytest.raises(ValueError, match="always, if-differ or never"):
        compare.run_compare(str(tmp_path), python="python", control="sometimes")


def _log(tmp_path: Path) -> Path:
    path = tmp_path / "on.log"
    path.write_text("DBO active in this process\n")
    return path
