"""The scenario/config input boundary (issues 9 and 16): every bad input is one line, exit 2.

Each case reproduces a class of input that used to escape as a traceback, a hang, a MemoryError
or a silently wrong answer.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from hardware_models import presets, safe_yaml
from hardware_models.units import UnitError, parse_quantity
from simulator.cli import main
from simulator.config.loader import load_scenario, resolve_hardware
from tests.conftest import ROOT

SCEN = str(ROOT / "scenarios/h200/gpt_184m_b8.yaml")
DL_SCEN = str(ROOT / "scenarios/h200/dataloader_w8.yaml")
BASE_TEXT = (ROOT / "scenarios/h200/gpt_184m_b8.yaml").read_text()


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if not ln.startswith("warning:")]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    return lines[0]


def run_set(capsys, *sets: str, scenario: str = SCEN) -> tuple[int, str]:
    argv = ["run", scenario, "--json"]
    for s in sets:
        argv += ["--set", s]
    rc = main(argv)
    return rc, (one_error_line(capsys) if rc == 2 else capsys.readouterr().err)


# -- files: encoding, size, kind -------------------------------------------------------------
def test_non_utf8_scenario(tmp_path, capsys):
    p = tmp_path / "s.yaml"
    p.write_bytes(BASE_TEXT.encode() + b"\ndescription: caf\xe9\n")
    assert main(["run", str(p)]) == 2
    line = one_error_line(capsys)
    assert str(p) in line and "not UTF-8" in line and "0xe9" in line


def test_non_utf8_profile_file(tmp_path, capsys):
    p = tmp_path / "prof.yaml"
    p.write_bytes(b"name: x\ngpu: \xff\xfe\n")
    rc, line = run_set(capsys, f"hardware.profile={p}")
    assert rc == 2 and "hardware.profile" in line and "not UTF-8" in line


def test_non_utf8_power_model_file(tmp_path, capsys):
    p = tmp_path / "power.yaml"
    p.write_bytes(b"name: \xff\n")
    rc, line = run_set(capsys, f"dvfs={{kind: locked_clock, locked_clocks_mhz: 1980, power_model: {p}}}")
    assert rc == 2 and "dvfs.power_model" in line and "not UTF-8" in line


def test_fifo_as_scenario_does_not_block(tmp_path, capsys):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    assert main(["run", str(fifo)]) == 2
    assert time.monotonic() - t0 < 5
    assert "not a regular file" in one_error_line(capsys)


def test_device_as_scenario(capsys):
    assert main(["run", "/dev/zero"]) == 2
    assert "not a regular file" in one_error_line(capsys)


def test_huge_file_refused_by_size_before_parsing(tmp_path, capsys):
    p = tmp_path / "big.yaml"
    with open(p, "wb") as fh:
        fh.write(BASE_TEXT.encode())
        fh.write(b"#" * (safe_yaml.MAX_FILE_BYTES + 1))
    t0 = time.monotonic()
    assert main(["run", str(p)]) == 2
    assert time.monotonic() - t0 < 5
    line = one_error_line(capsys)
    assert f"{safe_yaml.MAX_FILE_BYTES:,} bytes" in line


# -- YAML structure ---------------------------------------------------------------------------
def test_deep_nesting_in_file(tmp_path, capsys):
    p = tmp_path / "deep.yaml"
    p.write_text(BASE_TEXT + "description: " + "[" * 5000 + "]" * 5000 + "\n")
    assert main(["run", str(p)]) == 2
    assert f"nesting deeper than {safe_yaml.MAX_DEPTH} levels" in one_error_line(capsys)


def test_deep_nesting_in_set(capsys):
    rc, line = run_set(capsys, "hardware.gpu.overrides.l2_bytes=" + "{a: " * 5000 + "1" + "}" * 5000)
    assert rc == 2 and "--set hardware.gpu.overrides.l2_bytes" in line and "nesting deeper" in line


def test_alias_bomb_in_overrides(tmp_path, capsys):
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    bomb = "{" + ", ".join(ln.split(": ", 1)[0] + ": " + ln.split(": ", 1)[1] for ln in lines) + "}"
    rc, line = run_set(capsys, f"hardware.gpu.overrides.sources={bomb}")
    assert rc == 2 and f"more than {safe_yaml.MAX_NODES:,} values once aliases are expanded" in line


def test_recursive_alias_is_refused(capsys):
    """``&a [1, *a]`` is a list that contains itself: walking it would never end (found by the fuzz test)."""
    rc, line = run_set(capsys, "hardware.gpu.overrides.hbm_bandwidth_bytes_per_s=&a [1, *a]")
    assert rc == 2 and "recursive structure" in line


def test_duplicate_key_names_key_and_line(tmp_path, capsys):
    p = tmp_path / "dup.yaml"
    p.write_text(BASE_TEXT + "run:\n  steps: 9\n")
    assert main(["run", str(p)]) == 2
    line = one_error_line(capsys)
    first = next(i for i, ln in enumerate(BASE_TEXT.splitlines(), 1) if ln.startswith("run:"))
    assert "duplicate key 'run'" in line and f"first given at line {first}" in line
    assert f"line {len(BASE_TEXT.splitlines()) + 1}:" in line


@pytest.mark.parametrize("tag", ["!!python/object:os.system x", "!!binary aGVsbG8=", "!!set {a, b}",
                                 "!!timestamp 2001-12-14", "!!int abc", "!custom 3"])
def test_yaml_tags_refused(tmp_path, capsys, tag):
    p = tmp_path / "tag.yaml"
    p.write_text(BASE_TEXT.replace("name: gpt_184m_b8", f"name: {tag}"))
    assert main(["run", str(p)]) == 2
    line = one_error_line(capsys)
    assert str(p) in line and "line " in line


def test_yaml_12_scalars():
    """YAML 1.1 oddities are plain strings: yes/on, 1:30 (sexagesimal 90), dates."""
    assert safe_yaml.loads("a: yes\nb: 1:30\nc: 2001-12-14\nd: true\ne: 0x10\nf: .inf") == {
        "a": "yes", "b": "1:30", "c": "2001-12-14", "d": True, "e": 16, "f": float("inf")}


# -- wrong types ------------------------------------------------------------------------------
@pytest.mark.parametrize("setting,fragment", [
    ("hardware.gpu.overrides.l2_bytes=[[1]]", "overrides.l2_bytes: expected a number (a quantity"),
    ("hardware.gpu.overrides.hbm_capacity_bytes={a: 1}", "overrides.hbm_capacity_bytes: expected a number (a quantity"),
    ("hardware.host.overrides.memory=5", "overrides.memory: expected a mapping"),
    ("hardware.host.overrides.sources=5", "overrides: unknown key(s) sources (allowed: all_core_clock_mhz"),
    ("hardware.gpu.overrides.supported_sm_clocks_mhz=5", "overrides.supported_sm_clocks_mhz: expected a list"),
    ("hardware.gpu.overrides.name=[1]", "overrides: unknown key(s) name (allowed: fp8_gemm_tn_only"),
    ("hardware.gpu.overrides.sm_count=true", "overrides.sm_count: expected an integer"),
    ("hardware.gpu.overrides.peak_flops_per_s=5", "overrides.peak_flops_per_s: expected a mapping"),
    ("model.num_layers=true", "model.num_layers: Input should be a valid integer"),
    ("zero_optimization.stage=true", "zero_optimization.stage: expected a number (got true)"),
    ("run.steps=1:30", "run.steps"),
    ("hardware.launch_overhead_s=1:30", "hardware.launch_overhead_s: cannot parse '1:30'"),
    ("hardware.launch_overhead_s=false", "hardware.launch_overhead_s: expected a quantity"),
    ("name=2001-12-14", None),  # a date is a plain string: accepted as the name
])
def test_wrong_types(capsys, setting, fragment):
    rc, line = run_set(capsys, "run.steps=2", setting)
    if fragment is None:
        assert rc == 0
    else:
        assert rc == 2 and fragment in line, line


def test_timestamp_is_a_string_in_overrides():
    """A YAML 1.1 timestamp stays the string it is in a free-form overrides mapping (validated, not resolved:
    the GPU's ``name`` labels the preset and resolving refuses overriding it)."""
    from simulator.config.loader import read_yaml, scenario_from_dict
    from simulator.config.overrides import apply_overrides

    cfg = scenario_from_dict(apply_overrides(read_yaml(SCEN), ["hardware.gpu.overrides.name=2001-12-14t21:59:43.10-05:00"]))
    assert cfg.hardware.gpu.overrides["name"] == "2001-12-14t21:59:43.10-05:00"


# -- numbers out of range -------------------------------------------------------------------
@pytest.mark.parametrize("setting,fragment", [
    ("run.steps=" + "9" * 5000, "--set run.steps: integer with 5000 digits is out of range"),  # no 'line 1'
    ("run.seed=-" + "1" + "0" * 58, "integer with 59 digits is out of range"),
    ("run.seed=-1", "run.seed: Input should be greater than or equal to 0"),
    ("run.seed=9223372036854775808", "integer out of the 64-bit range"),
    ("hardware.gpu.overrides.hbm_bandwidth_bytes_per_s=1e400 TB/s", "'1e400 TB/s' is not a finite number"),
    ("hardware.gpu.overrides.hbm_bandwidth_bytes_per_s=1e300 PB/s", "overflows"),
    ("hardware.gpu.overrides.hbm_bandwidth_bytes_per_s=.nan", "not a finite number"),
    ("hardware.gpu.overrides.sm_count=.nan", "overrides.sm_count: expected a finite number"),
    ("hardware.gpu.overrides.tdp_w=-700", "overrides.tdp_w: must be >= 0"),
    ("hardware.gpu.overrides.peak_flops_per_s={bf16: .inf}", "not a finite number"),
    ("hardware.launch_overhead_s=.nan", "hardware.launch_overhead_s"),
])
def test_numbers_out_of_range(capsys, setting, fragment):
    rc, line = run_set(capsys, setting)
    assert rc == 2 and fragment in line, line


def test_integer_out_of_range_in_a_file_names_its_key(tmp_path, capsys):
    """A too-long integer in the scenario file names its line and key path (as the ``--set`` form names its
    key), also inside a list and a nested mapping."""
    big = "1" + "0" * 23
    path = tmp_path / "big.yaml"
    path.write_text(BASE_TEXT.replace("micro_batch_size: 8", f"micro_batch_size: {big}"))
    assert main(["run", str(path)]) == 2
    line_no = BASE_TEXT.splitlines().index("  micro_batch_size: 8") + 1
    assert one_error_line(capsys) == (f"error: {path}: line {line_no}: training.micro_batch_size: integer with 24 "
                                      "digits is out of range (at most 19 digits, i.e. 64-bit)")
    with pytest.raises(safe_yaml.YamlInputError, match=r"^line 2: a\[1\]\.b: integer out of the 64-bit range$"):
        safe_yaml.loads("x: 1\na: [1, {b: 9223372036854775808}]")


CLUSTER_SCEN = str(ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml")
POSITIVE = "must be > 0 (a bandwidth; 0 would make a transfer infinitely long), got "
POSITIVE_OR_UNSET = "must be > 0 (a bandwidth), or 0 for not given (the field's default), got -1.0"


@pytest.mark.parametrize("setting,fragment", [
    # a bandwidth that prices a transfer: a negative and a zero give the same rule, "> 0"
    ("hardware.pcie={preset: pcie-gen5-x16, overrides: {bandwidth_bytes_per_s: -1}}",
     "hardware.pcie: overrides.bandwidth_bytes_per_s: " + POSITIVE + "-1.0"),
    ("hardware.pcie={preset: pcie-gen5-x16, overrides: {bandwidth_bytes_per_s: 0}}",
     "hardware.pcie: overrides.bandwidth_bytes_per_s: " + POSITIVE + "0.0"),
    ("hardware.cluster.overrides={pcie_bytes_per_s: -5 GB/s}", "dgx-h100.pcie_bytes_per_s: " + POSITIVE + "-5000000000.0"),
    ("hardware.cluster.overrides={pcie_bytes_per_s: 0}", "dgx-h100.pcie_bytes_per_s: " + POSITIVE + "0.0"),
    ("hardware.host={preset: dgx-h100-host, overrides: {memory_bandwidth_bytes_per_s: -2}}",
     "overrides.memory_bandwidth_bytes_per_s: " + POSITIVE + "-2.0"),
    ("hardware.host={preset: dgx-h100-host, overrides: {memory_bandwidth_bytes_per_s: 0}}",
     "overrides.memory_bandwidth_bytes_per_s: " + POSITIVE + "0.0"),
    # a bandwidth whose default 0 means "not given" (pageable = pinned rate, unknown, no NVLink with intra pcie)
    ("hardware.pcie={preset: pcie-gen5-x16, overrides: {pageable_h2d_bytes_per_s: -1}}",
     "overrides.pageable_h2d_bytes_per_s: " + POSITIVE_OR_UNSET),
    ("hardware.host={preset: dgx-h100-host, overrides: {stream_bandwidth_bytes_per_s: -1}}",
     "overrides.stream_bandwidth_bytes_per_s: " + POSITIVE_OR_UNSET),
    ("hardware.cluster.overrides={nvlink_bytes_per_s: -1}", "dgx-h100.nvlink_bytes_per_s: " + POSITIVE_OR_UNSET),
    ("hardware.cluster.overrides={nvlink_bytes_per_s: 0}", "nvlink_bytes_per_s must be > 0, got 0.0"),  # nvswitch
])
def test_bandwidths_must_be_positive_one_rule(capsys, setting, fragment):
    """Hardware overrides of the PCIe link, the cluster and the host: a negative or zero bandwidth is refused
    with the same "> 0" rule (one line, exit 2); only fields whose default 0 means "not given" take 0."""
    rc, line = run_set(capsys, setting, scenario=CLUSTER_SCEN)
    assert rc == 2 and fragment in line, line


@pytest.mark.parametrize("nic", ["0", "-1"])
def test_network_bandwidth_must_be_positive(capsys, nic):
    rc, line = run_set(capsys, "hardware.cluster.nodes=2", f"hardware.cluster.network_overrides={{nic_bytes_per_s: {nic}}}",
                       scenario=CLUSTER_SCEN)
    assert rc == 2 and "ib-ndr-rail.nic_bytes_per_s: " + POSITIVE + f"{float(nic)}" in line, line


def test_num_workers_past_64_bits_is_refused_not_a_memory_error(capsys):
    rc, line = run_set(capsys, "dataloader.num_workers=9007199254740993", scenario=DL_SCEN)
    assert rc == 2 and "dataloader.num_workers: Input should be less than or equal to 4096" in line


@pytest.mark.parametrize("setting,limit", [
    ("training.micro_batch_size=4294967296", "1000000"),
    ("training.global_batch_size=" + str(10**18), "100000000"),
    ("model.seq_length=4294967296", "10000000"),
    ("model.hidden_size=4294967296", "1000000"),
    ("model.vocab_size=" + str(10**18), "10000000"),
    ("model.num_layers=1000000000", "10000"),
    ("model.ffn_hidden_size=4294967296", "4000000"),
    ("parallelism.data_parallel_size=4294967296", "1000000"),
    ("run.steps=1000000", "100000"),
])
def test_impossible_sizes_name_the_limit(capsys, setting, limit):
    rc, line = run_set(capsys, setting)
    assert rc == 2 and f"less than or equal to {limit}" in line, line


def test_gradient_accumulation_and_work_bounds(capsys):
    rc, line = run_set(capsys, "training.global_batch_size=800000")
    assert rc == 2 and "100,000 micro-batches per step" in line and "at most 10,000" in line
    rc, line = run_set(capsys, "model.num_layers=1000", "run.steps=101")
    assert rc == 2 and "101,000 layer passes" in line and "at most 100,000" in line


# -- the quantity parser ----------------------------------------------------------------------
def test_quantity_cache_does_not_confuse_true_with_one():
    assert parse_quantity(1, "s") == 1.0 and parse_quantity(0, "s") == 0.0
    for flag in (True, False):
        with pytest.raises(UnitError):
            parse_quantity(flag, "s")


def test_sweep_checks_false_after_zero(capsys):
    assert main(["sweep", SCEN, "--factor", "hardware.launch_overhead_s=0,false", "--json"]) == 2
    assert "hardware.launch_overhead_s" in one_error_line(capsys)


@pytest.mark.parametrize("text", ["9**9**9 s", "9^9^9 s", "2**99999999 s", "1 s**99999", "(9**9)**9 s",
                                  "1" * 70 + " s"])
def test_exponent_towers_are_refused_fast(text):
    t0 = time.monotonic()
    with pytest.raises(UnitError):
        parse_quantity(text, "s")
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("text,value", [("4.8 TB/s", 4.8e12), ("80 GiB", 80 * 2**30), ("2 us", 2e-6),
                                        ("1.98 GHz", 1980.0), ("989.4 TFLOP/s", 989.4e12), ("1 kB/ms", 1e6),
                                        ("3 byte / second", 3.0), ("1e3 W", 1000.0)])
def test_quantities_still_parse(text, value):
    dim = {"TB/s": "bytes_per_s", "GiB": "bytes", "us": "s", "GHz": "mhz", "TFLOP/s": "flops_per_s",
           "kB/ms": "bytes_per_s", "byte / second": "bytes_per_s", "W": "w"}[text.split(" ", 1)[1]]
    assert parse_quantity(text, dim) == pytest.approx(value, rel=1e-12)


# -- dict overrides merge; exit 2 instead of 1 -----------------------------------------------
def test_dtype_override_keeps_the_other_dtypes():
    """Used to replace the whole table: the fp32 lookup then failed in the run with exit 1."""
    cfg = load_scenario(SCEN, ["hardware.gpu.overrides.peak_flops_per_s={bf16: 900 TFLOP/s}"])
    peaks = resolve_hardware(cfg).gpu.peak_flops_per_s
    shipped = presets.get("gpus", "h200-sxm-141gb").peak_flops_per_s
    assert peaks["bf16"] == 900e12
    assert {k: v for k, v in peaks.items() if k != "bf16"} == {k: v for k, v in shipped.items() if k != "bf16"}


# -- pareto argument checks -----------------------------------------------------------------
@pytest.mark.parametrize("args,fragment", [(["--clocks", "0"], "--clocks"), (["--power-caps", "-3"], "--power-caps"),
                                           (["--clocks", "nan"], "--clocks"), (["--power-caps", "inf"], "--power-caps")])
def test_pareto_bad_settings_one_line(capsys, args, fragment):
    assert main(["pareto", SCEN, *args]) == 2
    line = one_error_line(capsys)
    assert fragment in line and "pydantic" not in line and "http" not in line


@pytest.mark.parametrize("args,want", [(["--power-caps", "300,1"], "--power-caps 1 W is outside the settable range of "),
                                       (["--clocks", "99999"], "--clocks: 99999 MHz is outside the SM clocks of ")])
def test_pareto_setting_outside_the_gpus_range_names_the_file(capsys, args, want):
    """The range is that of the scenario's GPU, so the line names the file that sets it; a cap named neither the file
    nor its flag ("dvfs.power_limit_w 1 W is outside ...", a key the user did not write). Refused before any point
    is simulated."""
    assert main(["pareto", SCEN, *args]) == 2
    assert one_error_line(capsys).startswith(f"error: {SCEN}: {want}")


def test_json_bad_input_gives_a_json_error_on_stdout(tmp_path, capsys):
    """``simulate run --json`` is read by scripts: on bad input stdout carries one JSON object (it was empty, so
    ``json.loads`` of it raised), stderr keeps the error lines, exit status 2; every problem is in it."""
    p = tmp_path / "s.yaml"
    p.write_text(BASE_TEXT + "\ngradient_clipping: banana\nprescale_gradients: true\n")
    assert main(["run", str(p), "--json"]) == 2
    out = capsys.readouterr()
    err = [ln.removeprefix("error: ") for ln in out.err.splitlines() if ln.startswith("error: ")]
    assert json.loads(out.out) == {"error": "; ".join(err), "errors": err, "exit_status": 2}
    assert len(err) == 2 and f"{p}: gradient_clipping: Input should be a valid number (got 'banana')" in err
    missing = str(tmp_path / "none.yaml")
    for verb in (["run"], ["pareto"], ["dataloader-workers"]):
        assert main([*verb, missing, "--json"]) == 2
        out = capsys.readouterr()
        assert json.loads(out.out) == {"error": f"{missing}: file not found", "errors": [f"{missing}: file not found"],
                                       "exit_status": 2}
        assert out.err == f"error: {missing}: file not found\n"
    assert main(["run", missing]) == 2 and capsys.readouterr().out == ""  # without --json: stderr only


def test_error_does_not_quote_a_huge_value(capsys):
    rc, line = run_set(capsys, "model.num_layers=" + "x" * 5000)
    assert rc == 2 and "model.num_layers" in line and len(line) < 300
