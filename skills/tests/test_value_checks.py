"""Template values that must agree are checked when rendering: tensor x data parallel size against the devices
listed in ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES, in each template that has both."""

from __future__ import annotations

from pathlib import Path

import pytest

SKILLS = Path(__file__).resolve().parents[1]

# (skill, template, where TP/DP live, the env mapping, the TP and DP keys)
CASES = [
    ("kv-cache-sizing", "launch_with_budget.sh", None, "extra_env", "tensor_parallel_size", "data_parallel_size"),
    ("dbo-debug", "launch_server.sh", None, "extra_env", "tensor_parallel_size", "data_parallel_size"),
    ("profile-overlap-analysis", "launch_server.sh", None, "extra_env", "tensor_parallel_size", "data_parallel_size"),
    ("vllm-serve-bench", "matrix.yaml", "server_args", "server_env", "tensor-parallel-size", "data-parallel-size"),
    ("dbo-benchmark", "matrix.yaml", "server_args", "server_env", "tensor-parallel-size", "data-parallel-size"),
]


def _values(examples, skill, template, where, env_key, tp_key, dp_key, tp, dp, devices, variable="ASCEND_RT_VISIBLE_DEVICES"):
    values = examples(skill, template)
    holder = values if where is None else values.setdefault(where, {})
    holder[tp_key], holder[dp_key] = tp, dp
    values[env_key] = {**{k: v for k, v in values.get(env_key, {}).items() if not k.endswith("VISIBLE_DEVICES")},
                       variable: devices}
    return values


@pytest.mark.parametrize(("skill", "template", "where", "env_key", "tp_key", "dp_key"), CASES,
                         ids=[f"{c[0]}/{c[1]}" for c in CASES])
def test_parallel_size_must_match_the_visible_devices(render_mod, examples, skill, template, where, env_key, tp_key,
                                                      dp_key) -> None:
    folder = SKILLS / skill
    good = _values(examples, skill, template, where, env_key, tp_key, dp_key, 2, 2, "0,1,2,3")
    assert render_mod.render(folder, template, good)
    cuda = _values(examples, skill, template, where, env_key, tp_key, dp_key, 2, 1, "4, 5", "CUDA_VISIBLE_DEVICES")
    assert render_mod.render(folder, template, cuda)
    bad = _values(examples, skill, template, where, env_key, tp_key, dp_key, 2, 2, "0,1")
    with pytest.raises(render_mod.RenderError) as caught:
        render_mod.render(folder, template, bad)
    message = str(caught.value)
    assert "\n" not in message and "lists 2 device(s)" in message and "needs 4" in message
    assert f"--set-str {env_key}.ASCEND_RT_VISIBLE_DEVICES=0,1,2,3" in message


def test_the_cli_refuses_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(SKILLS / "kv-cache-sizing" / "scripts" / "render.py"),
                           "launch_with_budget", "--example", "--set", "tensor_parallel_size=2", "-o", "launch.sh"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        "render.py: kv-cache-sizing/launch_with_budget.sh.j2: ASCEND_RT_VISIBLE_DEVICES=0 lists 1 device(s), but "
        "tensor_parallel_size 2 x data_parallel_size 1 needs 2: add --set-str extra_env.ASCEND_RT_VISIBLE_DEVICES=0,1 "
        "(or the device ids you were given), or change the parallel sizes")
    assert list(tmp_path.iterdir()) == []
