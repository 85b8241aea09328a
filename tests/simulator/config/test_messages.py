"""Bad-input messages of a fresh-user trial: each names the real key path, shows the value, hints a key of
another section, and prints no warning for a scenario it refuses."""

from __future__ import annotations

import warnings

import pytest

from simulator.cli import main
from simulator.config.errors import ScenarioError, ScenarioWarning
from simulator.config.loader import load_scenario
from tests.conftest import ROOT

DP8 = str(ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml")


def _err(capsys, *sets: str, verb: str = "run", extra: tuple = ()) -> tuple[int, str]:
    argv = [verb, DP8, *extra]
    for s in sets:
        argv += ["--set", s]
    rc = main(argv)
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize("setting,key", [("hardware.host.threads=0", "hardware.host.threads"),
                                         ("training.micro_batch_size=0", "training.micro_batch_size"),
                                         ("model.num_attention_heads=0", "model.num_attention_heads"),
                                         ("training.micro_batch_size=-1", "training.micro_batch_size")])
def test_an_out_of_range_value_is_shown(capsys, setting, key):
    """pydantic's "greater than 0" never names the value: a 0 given is shown as a -1 is."""
    rc, err = _err(capsys, setting)
    value = setting.split("=")[1]
    assert rc == 2 and "\n" not in err
    assert f": {key}: Input should be greater than 0 (got {value}) (from the command line: {key}=...)" in err


def test_threads_beyond_the_cores_names_the_threads_key(capsys):
    rc, err = _err(capsys, "hardware.host.threads=1000")
    assert rc == 2 and "\n" not in err
    assert f"{DP8}: hardware.host.threads: threads 1000 exceeds the 112 physical cores" in err and "overrides" not in err


def test_a_numa_node_that_does_not_exist_names_its_key(capsys):
    rc, err = _err(capsys, "hardware.host.numa_node=7")
    assert rc == 2 and f"{DP8}: hardware.host.numa_node: numa_node 7 does not exist" in err


def test_list_indices_are_bracketed(capsys):
    rc, err = _err(capsys, "rank_overrides=[{dp_rank: 0, slowdown: -1}]")
    assert rc == 2 and "\n" not in err
    assert err.endswith(": rank_overrides[0].slowdown: Input should be greater than 0 (got -1) (from the command line: "
                        "rank_overrides=...)")


@pytest.mark.parametrize("setting,hint", [("model.sequence_parallel=true", "parallelism.sequence_parallel"),
                                          ("training.nodes=2", "hardware.cluster.nodes"),
                                          ("model.slowdown=2", "rank_overrides[i].slowdown")])
def test_a_key_of_another_section_is_pointed_to(capsys, setting, hint):
    rc, err = _err(capsys, setting)
    assert rc == 2 and "\n" not in err and f"unknown key (allowed: " in err and f"; did you mean {hint}?" in err


@pytest.mark.parametrize("setting,where,allowed_start", [
    ("hardware.gpu.overrides.name=B200", "hardware.gpu: overrides", "fp8_gemm_tn_only, hbm_bandwidth_bytes_per_s"),
    ("hardware.gpu.overrides.sources={a: b}", "hardware.gpu: overrides", "fp8_gemm_tn_only, hbm_bandwidth_bytes_per_s"),
    ("hardware.host.overrides.name=x", "hardware.host: overrides", "all_core_clock_mhz, base_clock_mhz"),
    ("hardware.pcie={preset: pcie-gen5-x16, overrides: {name: x}}", "hardware.pcie: overrides", "bandwidth_bytes_per_s"),
    ("hardware.cluster.overrides.name=x", "hardware.cluster.overrides: preset clusters/dgx-h100", "collective_profile"),
])
def test_a_preset_label_is_not_overridable(capsys, setting, where, allowed_start):
    """``name`` / ``sources`` label a preset (only the output's "gpu" column reads the name): an override of
    them would relabel the numbers, so it is refused and not listed as allowed."""
    rc, err = _err(capsys, setting)
    bad = "name" if "{name" in setting else setting.split("=")[0].rsplit(".", 1)[1]
    assert rc == 2 and "\n" not in err and f"{where}: unknown key(s) {bad} (allowed: {allowed_start}" in err
    allowed = err.split("(allowed: ")[1].split(")")[0].split(", ")
    assert "name" not in allowed and "sources" not in allowed and "label the preset" in err


def test_an_invalid_scenario_prints_its_error_and_no_warning(capsys):
    rc, err = _err(capsys, "hardware.cluster.network=nope")
    assert rc == 2 and err.splitlines() == [
        f"error: {DP8}: hardware.cluster.network: unknown network preset 'nope'; known: ib-hdr, ib-ndr-rail, roce-400g"]


def test_a_valid_scenario_still_warns():
    with pytest.warns(ScenarioWarning, match="one node has no scale-out network"):
        load_scenario(DP8, ["hardware.cluster.network=ib-hdr"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ScenarioError, match="unknown network preset 'nope'"):
            load_scenario(DP8, ["hardware.cluster.network=nope"])


def test_a_key_the_search_sets_is_not_blamed_on_the_command_line(capsys):
    """The scenario leaves training.global_batch_size unset: the search fixes it at micro_batch_size 8 x dp 8 =
    64, which micro-batch 64 x dp 8 = 512 does not divide."""
    rc = main(["search", DP8, "--space", "training.micro_batch_size=64,128"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert "training.global_batch_size: 64 must be a multiple of micro_batch_size x data_parallel_size (512)" in err
    assert "(set by the search to the scenario's micro_batch_size x data_parallel_size, 64, for every point" in err
    assert "from the command line" not in err
