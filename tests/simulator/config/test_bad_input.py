"""Bad scenarios give one line per problem naming the file, the key and what is allowed; exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from simulator.cli import main
from tests.conftest import ROOT

BASE = yaml.safe_load((ROOT / "scenarios/h200/gpt_184m_b8.yaml").read_text())


def write(tmp_path: Path, data) -> Path:
    p = tmp_path / "bad.yaml"
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def mutate(path: list[str], value):
    d = yaml.safe_load(yaml.safe_dump(BASE))
    node = d
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return d


CASES = [
    ("unknown key", mutate(["model", "num_layerz"], 3), ["model.num_layerz", "unknown key", "num_layers"]),
    ("wrong unit", mutate(["hardware", "gpu"], {"preset": "h200-sxm-141gb",
                                                 "overrides": {"hbm_bandwidth_bytes_per_s": "4.8 TB"}}),
     ["hardware.gpu", "hbm_bandwidth_bytes_per_s", "bytes/s"]),
    ("misspelt preset", mutate(["hardware", "gpu"], "h200-sxm"), ["hardware.gpu", "h200-sxm", "h200-sxm-141gb"]),
    ("missing profile", mutate(["hardware", "profile"], "nope"), ["hardware.profile", "nope"]),
    ("negative size", mutate(["model", "hidden_size"], -8), ["model.hidden_size", "greater than 0"]),
    ("zero batch", mutate(["training", "micro_batch_size"], 0), ["training.micro_batch_size", "greater than 0"]),
    ("heads do not divide", mutate(["model", "num_attention_heads"], 7), ["num_attention_heads (7) must divide"]),
    ("missing key", {k: v for k, v in BASE.items() if k != "model"}, ["model", "required"]),
    ("bad precision", mutate(["training", "precision"], "fp8"), ["training.precision", "amp_fp32_params"]),
    # a misspelt required key is an unknown key first (not "micro_batch_size: required key is missing")
    ("misspelt required key", {**BASE, "training": {**{k: v for k, v in BASE["training"].items()
                                                      if k != "micro_batch_size"}, "micro_bach_size": 8}},
     ["training.micro_bach_size", "unknown key", "did you mean 'micro_batch_size'"]),
    ("misspelt section", {**{k: v for k, v in BASE.items() if k != "training"}, "trainig": BASE["training"]},
     ["trainig: unknown key", "did you mean 'training'"]),
    # a field of a preset reference written as if hardware.gpu were the spec: no class names, the keys allowed
    ("field on a preset name", mutate(["hardware", "gpu"], {"memory_bandwidth": "4.8 TB/s"}),
     ["hardware.gpu.memory_bandwidth: unknown key (allowed: overrides, preset)"]),
    ("missing kind lists the kinds", {**BASE, "dvfs": {"power_limit_w": 500}},
     ["dvfs.kind: required key is missing (allowed: 'locked_clock', 'power_cap', 'phase_plan')"]),
    # was snapped to 1980 MHz with a warning: a typo ran at the maximum clock
    ("locked clock above the GPU's range", {**BASE, "dvfs": {"kind": "locked_clock", "locked_clocks_mhz": 14100}},
     ["dvfs.locked_clocks_mhz: 14100 MHz is outside the SM clocks of NVIDIA H200 SXM 141GB (allowed: 345-1980 MHz)"]),
    ("phase clock below the GPU's range", {**BASE, "dvfs": {"kind": "phase_plan", "phase_clocks_mhz": {"opt": 100}}},
     ["dvfs.phase_clocks_mhz.opt: 100 MHz is outside the SM clocks of NVIDIA H200 SXM 141GB (allowed: 345-1980 MHz)"]),
    ("fsdp mixed precision not a preset", {**BASE, "fsdp": {"mixed_precision": "bf16"}},
     ["fsdp.mixed_precision: 'bf16' (allowed: DEFAULT, PURE, FULL, or {param_dtype: bf16 | fp32, reduce_dtype: bf16 | "
      "fp32})"]),
    # a mapping for a union of a scalar and a model: the model branch's error, no union tags in the path
    ("fsdp mixed precision bad dtype", {**BASE, "fsdp": {"mixed_precision": {"param_dtype": "fp16"}}},
     ["fsdp.mixed_precision.param_dtype: Input should be 'bf16' or 'fp32' (got 'fp16')"]),
    ("fsdp cpu_offload bad bool", {**BASE, "fsdp": {"cpu_offload": {"offload_params": "maybe"}}},
     ["fsdp.cpu_offload.offload_params: Input should be a valid boolean (got 'maybe')"]),
    ("host mapping without preset", mutate(["hardware", "host"], {"threads": 4}),
     ["hardware.host.preset: required key is missing"]),
    ("from_hf in neither folder", {**BASE, "model": {"from_hf": "./nope.json"}},
     ["model.from_hf: ./nope.json not found (looked for", "from the scenario's folder)"]),
    # was ignored without a word: the run used the power cap at the maximum clock
    ("locked clock with kind power_cap",
     {**BASE, "dvfs": {"kind": "power_cap", "power_limit_w": 400, "locked_clocks_mhz": 1410}},
     ["dvfs: locked_clocks_mhz applies to dvfs kind locked_clock only, not power_cap (a locked clock under a power "
      "limit: kind locked_clock with power_limit_w)"]),
]


#: the problems after the first one a case has too, one line each; a key a typo left missing is not repeated when
#: the typo's line names it ("did you mean ..."): the misspelt cases have none
ALSO = {"field on a preset name": ["hardware.gpu.preset: required key is missing"]}


@pytest.mark.parametrize("label,data,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_scenario_one_line_exit_2(tmp_path, capsys, label, data, expected):
    p = write(tmp_path, data)
    assert main(["run", str(p)]) == 2
    lines = capsys.readouterr().err.strip().split("\n")
    assert all(line.startswith(f"error: {p}: ") for line in lines) and "Traceback" not in "".join(lines)
    for fragment in expected:
        assert fragment in lines[0], f"{label}: {fragment!r} not in {lines[0]!r}"
    assert [line.split(": ", 2)[2] for line in lines[1:]] == ALSO.get(label, [])


def test_yaml_syntax_error(tmp_path, capsys):
    p = write(tmp_path, "name: x\nmodel: [1, 2\n")
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "YAML syntax error at line" in err and str(p) in err


@pytest.mark.parametrize("text, where", [
    ('[activation_checkpoint]\nmode = "selective"\n', "line 2, column 1: expected '<document start>', but found '<scalar>'"),
    ('name: x\n[activation_checkpoint]  # from torchtitan\nmode = "selective"\n', "line 3, column 1: could not find "
     "expected ':'"),
])
def test_toml_pasted_as_yaml_gets_a_hint(tmp_path, capsys, text, where):
    """A torchtitan TOML section pasted as-is: the YAML error says it looks like TOML and shows the section as a YAML
    mapping, in one line. Before, only the YAML error."""
    p = write(tmp_path, text)
    assert main(["run", str(p)]) == 2
    assert capsys.readouterr().err == (
        f"error: {p}: YAML syntax error at {where}; it looks like TOML ([activation_checkpoint] headers, key = value "
        "lines): write it as a YAML mapping, activation_checkpoint: {mode: selective}\n")


def test_yaml_error_without_toml_lines_gets_no_toml_hint(tmp_path, capsys):
    p = write(tmp_path, "name: x\nmodel: [1, 2\nmode = 3\n")  # a key = value line but no [section] header
    assert main(["run", str(p)]) == 2
    assert "TOML" not in capsys.readouterr().err


def test_missing_file(capsys):
    assert main(["run", "does/not/exist.yaml"]) == 2
    assert "does/not/exist.yaml: file not found" in capsys.readouterr().err


def test_bad_set_override(capsys):
    assert main(["run", str(ROOT / "scenarios/h200/gpt_184m_b8.yaml"), "--set", "training.micro_batch_size=-1"]) == 2
    assert "training.micro_batch_size" in capsys.readouterr().err


def test_console_script_no_traceback(tmp_path):
    """The installed entry point (python -m simulator) prints one line and exits 2."""
    p = write(tmp_path, mutate(["model", "num_layerz"], 3))
    proc = subprocess.run([sys.executable, "-m", "simulator", "run", str(p)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_implausible_bare_number_needs_a_unit(capsys):
    """4.8 (no unit) would be 4.8 B/s and an endless run: rejected, asking for a unit."""
    scen = str(ROOT / "scenarios/h200/gpt_184m_b8.yaml")
    assert main(["run", scen, "--set", "hardware.gpu.overrides.hbm_bandwidth_bytes_per_s=4.8"]) == 2
    err = capsys.readouterr().err
    assert "hbm_bandwidth_bytes_per_s" in err and "give a unit" in err


def test_profile_file_with_yaml_error(tmp_path, capsys):
    bad = tmp_path / "prof.yaml"
    bad.write_text("gemm: [1\n")
    assert main(["run", str(ROOT / "scenarios/h200/gpt_184m_b8.yaml"), "--set", f"hardware.profile={bad}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "hardware.profile" in err and "YAML syntax error" in err and "\n" not in err


def test_trace_verbs_reject_bad_arguments(tmp_path, capsys):
    trace = str(ROOT / "tests/data/h200/trace_gpt_184m_b16.json.gz")
    with pytest.raises(SystemExit) as e:
        main(["replay", trace, "--steps", "foo"])
    assert e.value.code == 2
    capsys.readouterr()
    assert main(["calibrate", trace, "--scenario", str(ROOT / "scenarios/h200/gpt_184m_b16.yaml"),
                 "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_unknown_key_suggests_the_closest(capsys):
    assert main(["run", str(ROOT / "scenarios/h200/gpt_184m_b8.yaml"), "--set", "training.micro_batch_sizee=4"]) == 2
    assert "did you mean 'micro_batch_size'?" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    ([], "the following arguments are required"),
    (["run"], "simulate run: the following arguments are required: scenario"),
    (["collective", "dgx-h100", "--ranks", "abc"], "argument --ranks: invalid int value"),
])
def test_argument_errors_are_one_line(argv, needle):
    proc = subprocess.run([sys.executable, "-m", "simulator", *argv], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr


def test_out_of_memory_summary_says_the_times_are_hypothetical(capsys):
    """Activations over capacity (the persistent state fits): simulated, its times hypothetical. Hidden size 16384
    (the persistent state alone over capacity): not simulated, no times (``api.run_scenario``)."""
    rc = main(["run", str(ROOT / "scenarios/h200/gpt_184m_b8.yaml"), "--set", "training.micro_batch_size=256",
               "--set", "run.steps=2"])
    out = capsys.readouterr().out
    assert rc == 1 and "OUT OF MEMORY" in out and "what the step would take if it fit" in out
    rc = main(["run", str(ROOT / "scenarios/h200/gpt_184m_b8.yaml"), "--set", "model.hidden_size=16384",
               "--set", "run.steps=2"])
    out = capsys.readouterr().out
    assert rc == 1 and "OUT OF MEMORY" in out and "step time           not simulated" in out
    assert "what the step would take if it fit" not in out


def test_an_override_far_from_the_preset_is_a_warning():
    """``4.8 TB/h`` is a bandwidth, but 3,600x below the H200's 4.8 TB/s: likely a unit slip (fresh-user trial)."""
    from simulator.config.errors import ScenarioWarning
    from simulator.config.loader import load_scenario

    scen = ROOT / "scenarios/h200/gpt_184m_b8.yaml"
    slip = "hardware.gpu={preset: h200-sxm-141gb, overrides: {hbm_bandwidth_bytes_per_s: 4.8 TB/h}}"
    with pytest.warns(ScenarioWarning, match="hbm_bandwidth_bytes_per_s: 1.333e\\+09 is 3,600x below"):
        load_scenario(scen, [slip])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", ScenarioWarning)  # a 20% what-if stays silent
        load_scenario(scen, ["hardware.gpu={preset: h200-sxm-141gb, overrides: {hbm_bandwidth_bytes_per_s: 4 TB/s}}"])


def test_a_bad_value_is_reported_before_missing_keys(tmp_path, capsys):
    p = write(tmp_path, "training: {micro_batch_size: -3}\n")
    assert main(["run", str(p)]) == 2
    assert capsys.readouterr().err.strip().split("\n") == [
        f"error: {p}: training.micro_batch_size: Input should be greater than 0 (got -3)",
        f"error: {p}: name: required key is missing", f"error: {p}: hardware: required key is missing",
        f"error: {p}: model: required key is missing"]


def test_every_problem_of_a_file_one_line_each(tmp_path, capsys):
    """A file with five problems lists all five (it showed the first and "[+4 more]"): unknown keys first, then
    bad values in the file's order, then missing keys; each line names the file and the key path; exit 2."""
    model = {**BASE["model"], "num_layers": -1, "bogus": 3}
    p = write(tmp_path, {**BASE, "model": model, "training": {**BASE["training"], "micro_batch_size": "abc",
                                                               "precision": "bf17"}, "run": 3})
    assert main(["run", str(p)]) == 2
    lines = capsys.readouterr().err.strip().split("\n")
    assert [line.split(": ")[2] for line in lines] == ["model.bogus", "model.num_layers", "training.micro_batch_size",
                                                       "training.precision", "run"]
    assert all(line.startswith(f"error: {p}: ") for line in lines)
    assert lines[4].endswith("run: expected a mapping of keys (fidelity, rank_folding, seed, steps, warmup_steps) "
                             "(got 3)")


@pytest.mark.parametrize("unknown,shown", [(20, 20), (25, 20)])
def test_many_problems_are_capped_at_20(tmp_path, capsys, unknown, shown):
    """20 problems: all 20 lines; 25: the first 20 and "... and 5 more" (only past the cap)."""
    p = write(tmp_path, {**BASE, "model": {**BASE["model"], **{f"k{i:02d}": 1 for i in range(unknown)}}})
    assert main(["run", str(p)]) == 2
    lines = capsys.readouterr().err.strip().split("\n")
    assert [line.split(": ")[2] for line in lines[:shown]] == [f"model.k{i:02d}" for i in range(shown)]
    assert lines[shown:] == ([f"error: {p}: ... and {unknown - shown} more"] if unknown > shown else [])


@pytest.mark.parametrize("override,line", [
    ("training=5", "training: expected a mapping of keys (clip_grad, cross_entropy, enable_cpu_offload, fp8, "
     "fp8_amax_history_len, "
     "fp8_param_gather, "
     "global_batch_size, lora, micro_batch_size, optimizer, precision, recompute_granularity) (got 5)"),
    ("hardware.gpu=5", "hardware.gpu: expected a string or a mapping of keys (overrides, preset) (got 5)"),
    ("hardware.host=[1]", "hardware.host: expected a string or a mapping of keys (bind_cores_to_rank, "
     "numa_node, overrides, pcie_switches, preset, threads)"),
    ("rank_overrides=[1]", "rank_overrides[0]: expected a mapping of keys (dp_rank, dvfs, gpu, pp_rank, slowdown) "
     "(got 1)"),
    ("zero_optimization.offload_optimizer=off", "zero_optimization.offload_optimizer: expected a mapping of keys "
     "(buffer_count, cpu_adam_impl, device, fast_init, mode, nvme_path, pin_memory, pipeline_read, pipeline_write) (got 'off')"),
    ("hardware.gpu={preset: h200-sxm-141gb, overrides: {bogus: 1}}", "hardware.gpu: overrides: unknown key(s) bogus "
     "(allowed: fp8_gemm_tn_only, hbm_bandwidth_bytes_per_s, "),
])
def test_a_section_of_the_wrong_type_names_its_keys_not_a_class(capsys, override, line):
    """A section given a scalar or a list: the key path and the keys it takes, never the schema's class names
    (was "Input should be a valid dictionary or instance of TrainingConfig", "... of PresetRef ... [+1 more]")."""
    scen = str(ROOT / "scenarios/h200/gpt_184m_b8.yaml")
    assert main(["run", scen, "--set", override]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"error: {scen}: {line}" in err
    assert not any(w in err for w in ("Config", "PresetRef", "HostRef", "RankOverride", "instance of", "['"))


def test_a_bad_value_from_set_is_named_as_such(capsys):
    assert main(["run", str(ROOT / "scenarios/h200/gpt_184m_b8.yaml"), "--set", "training.micro_batch_size=-3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith("(got -3) (from the command line: training.micro_batch_size=...)")
