"""Units, presets with overrides and --set overrides."""

from __future__ import annotations

import json

import pytest

from simulator.cli import main
from simulator.config.loader import load_scenario, resolve_hardware
from tests.conftest import ROOT

SCEN = ROOT / "scenarios/h200/gpt_184m_b8.yaml"


def test_set_override_types_and_nesting():
    cfg = load_scenario(SCEN, ["training.micro_batch_size=4", "hardware.gpu.overrides.hbm_bandwidth_bytes_per_s=3 TB/s"])
    assert cfg.training.micro_batch_size == 4
    hw = resolve_hardware(cfg)
    assert hw.gpu.hbm_bandwidth_bytes_per_s == 3e12
    assert hw.gpu.peak("bf16") == pytest.approx(989.4e12)  # other fields keep the preset's values


def test_binary_and_decimal_prefixes():
    cfg = load_scenario(SCEN, ["hardware.gpu.overrides.hbm_capacity_bytes=80 GiB"])
    assert resolve_hardware(cfg).gpu.hbm_capacity_bytes == 80 * 2**30


def test_json_output_has_required_keys(capsys):
    assert main(["run", str(SCEN), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "samples_per_s", "tokens_per_s", "mfu", "peak_memory_bytes", "phase_s"):
        assert key in out
    assert set(out["phase_s"]) == {"data_s", "fwd_s", "bwd_s", "opt_s"}


def test_out_dir_files_and_perfetto_trace(tmp_path, capsys):
    assert main(["run", str(SCEN), "--out", str(tmp_path)]) == 0
    assert f"outputs             {tmp_path}/" in capsys.readouterr().out
    names = {p.name for p in tmp_path.iterdir()}
    assert {"config.resolved.yaml", "summary.json", "spans.csv", "trace.json"} <= names
    trace = json.loads((tmp_path / "trace.json").read_text())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert xs and all(e["dur"] >= 0 and "ts" in e for e in xs)


def test_schema_and_presets_commands(capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "model" in schema["properties"]
    assert main(["presets"]) == 0
    assert "h200-sxm-141gb" in capsys.readouterr().out


def test_scenarios_readme_is_up_to_date():
    """scenarios/README.md is generated from the schema; regenerate with scripts/gen_scenarios_readme.py."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts/gen_scenarios_readme.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "scenarios/README.md").read_text() == gen.render()


def test_scenarios_readme_states_the_layer_pass_bound_the_schema_enforces():
    """The guide said 1,000,000 layer passes per run; the schema refuses above limits.MAX_LAYER_PASSES (100,000):
    a run of exactly that many passes loads, one step more is refused naming the bound the README gives."""
    from simulator.config.errors import ScenarioError
    from simulator.config.limits import MAX_LAYER_PASSES

    text = (ROOT / "scenarios/README.md").read_text()
    assert f"  {MAX_LAYER_PASSES:,} layer passes (layers x micro-batches x steps) per run" in text
    assert "1,000,000 layer passes" not in text
    b4 = ROOT / "scenarios/h200/gpt_184m_b4.yaml"  # 12 layers, one micro-batch per step
    steps = MAX_LAYER_PASSES // 12
    assert load_scenario(b4, [f"run.steps={steps}"]).run.steps == steps  # 99,996 passes
    with pytest.raises(ScenarioError, match=f"at most {MAX_LAYER_PASSES:,} are simulated in one run"):
        load_scenario(b4, [f"run.steps={steps + 1}"])


def test_validate_command_subset_and_unknown_case(capsys):
    assert main(["validate", "gpt_184m_b8.step_time", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["case_id"] == "gpt_184m_b8.step_time" and abs(rows[0]["error"]) < 0.10
    assert rows[0]["within"] is True and rows[0]["known_gap"] is None and rows[0]["tolerance_of"] == "error"
    assert main(["validate", "gpt_184m_b8.step_time"]) == 0  # no known gap among the rows: no gap heading
    assert "known gaps (sources" not in capsys.readouterr().out
    assert main(["validate", "no_such_case"]) == 2
    assert "unknown validation case" in capsys.readouterr().err


def test_an_unknown_validation_case_is_one_short_line(capsys):
    """``validate NOPE``: one line naming it, the closest case and the case families (it printed all 41 ids)."""
    from simulator.studies.validation import all_cases

    stems = sorted({c.case_id.replace("-", ".").split(".")[0] for c in all_cases()}, key=str.lower)
    assert "MLM20" in stems and "gpt_184m_b8" in stems and "gpt_184m_b8.step_time" not in stems
    assert main(["validate", "NOPE"]) == 2
    assert capsys.readouterr().err == (f"error: unknown validation case 'NOPE'; known: {', '.join(stems)} (a name "
                                       "selects every case it begins)\n")
    assert main(["validate", "gpt_184m_b9.step_time"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'gpt_184m_b8.step_time'?" in err and ".avg_power_w" not in err


def test_data_context_parallel_size_is_the_one_dp_x_cp_rule():
    """The gradient reduce group the warnings, the builder spec and the sharding checks read: dp x cp (Megatron-LM
    ``get_data_parallel_world_size(with_context_parallel=True)``); 1 without a cluster."""
    b16 = ROOT / "scenarios/h200/gpt_184m_b16.yaml"
    assert load_scenario(b16).parallelism.data_context_parallel_size == 1
    cl = ["hardware.gpu=h100-sxm-80gb", "hardware.cluster={preset: dgx-h100}", "training.precision=bf16"]
    p = load_scenario(b16, cl + ["parallelism.tensor_model_parallel_size=2",
                                 "parallelism.context_parallel_size=2"]).parallelism
    assert (p.data_parallel_size, p.context_parallel_size, p.data_context_parallel_size) == (2, 2, 4)


def test_a_host_override_far_from_its_preset_is_warned_once(capsys):
    """A host override 1,000x off its preset (a unit slip: bytes for MB) is warned, once, as a GPU's or a link's
    is; the memory block's fields too. Before, host overrides were never checked, and a GPU's was printed twice
    by `simulate run` (the load, then the run's own resolve)."""
    b8 = str(ROOT / "scenarios/h200/gpt_184m_b8.yaml")
    host = ("hardware.host={preset: h200-measured-host, overrides: {memory_bandwidth_bytes_per_s: 67e6, "
            "memory: {capacity_bytes: 125e6}}}")
    gpu = "hardware.gpu={preset: h200-sxm-141gb, overrides: {hbm_bandwidth_bytes_per_s: 4.8e9}}"
    assert main(["run", b8, "--set", host, "--set", gpu, "--set", "model.num_layers=2", "--set", "run.steps=2",
                 "--set", "run.warmup_steps=1"]) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.endswith("check the unit")]
    assert err == [
        "warning: hardware.gpu.overrides.hbm_bandwidth_bytes_per_s: 4.8e+09 is 1,000x below the preset's 4.8e+12 "
        "(SI units); check the unit",
        "warning: hardware.host.overrides.memory_bandwidth_bytes_per_s: 6.7e+07 is 1,001x below the preset's "
        "6.705e+10 (SI units); check the unit",
        "warning: hardware.host.overrides.memory.capacity_bytes: 1.25e+08 is 1,074x below the preset's 1.342e+11 "
        "(SI units); check the unit"], err


def test_cluster_overrides_far_from_their_preset_are_warned_once(capsys):
    """``hardware.cluster.overrides`` and ``network_overrides`` 1,000x off the preset (bytes/s written as MB/s) are
    warned once each, as a GPU's override is. Before, they were not checked."""
    s = str(ROOT / "scenarios/cluster/gpt_6p7b_2x_dgx_h200_vpp2_powercap.yaml")
    assert main(["run", s, "--set", "hardware.cluster.network_overrides={nic_bytes_per_s: 50e6}", "--set",
                 "hardware.cluster.overrides={nvlink_bytes_per_s: 450e6}", "--set", "run.steps=2", "--set",
                 "run.warmup_steps=1"]) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.endswith("check the unit")]
    assert err == [
        "warning: hardware.cluster.overrides.nvlink_bytes_per_s: 4.5e+08 is 1,000x below the preset's 4.5e+11 "
        "(SI units); check the unit",
        "warning: hardware.cluster.network_overrides.nic_bytes_per_s: 5e+07 is 1,000x below the preset's 5e+10 "
        "(SI units); check the unit"], err


def test_host_memory_bandwidth_override_scales_the_sustained_bandwidth(capsys):
    """An override of the host's ``memory_bandwidth_bytes_per_s`` alone (the field ``simulate presets`` shows) moves
    the sustained figure the CPU optimizer step uses by the same factor, with one warning saying so. h200-measured-host:
    memory 67.05 GB/s, fitted stream 98.11 GB/s; at 100 GB/s the stream figure is 98.11 x 100 / 67.05 = 146.3236 GB/s,
    so the run equals one with that stream figure set directly. Before, the CPU optimizer stayed at 329.8 ms."""
    s = str(ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml")
    cfg = load_scenario(s, ["hardware.host.overrides.memory_bandwidth_bytes_per_s=100 GB/s"])
    with pytest.warns(UserWarning, match=r"memory_bandwidth_bytes_per_s: the host's sustained streaming bandwidth "
                      r"\(CPU optimizer step, host copies\) scales with it: 98.11 GB/s x 100 / 67.05 = 146.3 GB/s"):
        cpu = resolve_hardware(cfg, warn_every_time=True).host_cpu
    assert cpu.sustained_bandwidth_bytes_per_s == pytest.approx(146.3236e9, rel=1e-6)
    # an explicit stream figure wins, and nothing is scaled
    cfg = load_scenario(s, ["hardware.host.overrides={memory_bandwidth_bytes_per_s: 100e9, "
                            "stream_bandwidth_bytes_per_s: 50e9}"])
    assert resolve_hardware(cfg, warn_every_time=True).host_cpu.sustained_bandwidth_bytes_per_s == 50e9
    runs = [["--set", "hardware.host.overrides.memory_bandwidth_bytes_per_s=100 GB/s"],
            ["--set", "hardware.host.overrides.stream_bandwidth_bytes_per_s=146.3236 GB/s"], []]
    outs = []
    for extra in runs:
        capsys.readouterr()
        assert main(["run", s, "--json", *extra]) == 0
        outs.append(json.loads(capsys.readouterr().out)["step_time_s"])
    assert outs[0] == pytest.approx(outs[1], rel=1e-6) and outs[0] < outs[2] - 0.05  # 331.8 vs 389.2 ms
