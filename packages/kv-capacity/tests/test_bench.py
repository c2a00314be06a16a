"""The benchmark writes its JSON with one row per preset and setting, consistent with plan()."""

from __future__ import annotations

import json

from kv_capacity import load_model, plan, preset_names
from kv_capacity.bench import BUDGETS_GIB, LENGTHS, main


def test_bench_writes_json(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "out"), "--seconds", "0.05"]) == 0
    data = json.loads((tmp_path / "out" / "kv_capacity.json").read_text())
    rows = data["capacity"]
    assert len(rows) == len(preset_names()) * len(BUDGETS_GIB) * len(LENGTHS)
    for row in rows[:: len(LENGTHS)]:
        expected = plan(
            load_model(row["model"]),
            kv_cache_memory_bytes=row["kv_cache_memory_gib"] << 30,
            max_model_len=row["max_model_len"],
        )
        assert row["kv_cache_tokens"] == expected.kv_cache_tokens
    assert all(rate > 0 for rate in data["plans_per_second"].values())
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.endswith(".tmp")]
    assert "qwen3-8b" in capsys.readouterr().out
