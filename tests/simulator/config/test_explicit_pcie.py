"""An explicit ``hardware.pcie`` replaces the GPU profile's measured host-copy rates (trial finding: on the H200
profiles ``--set hardware.pcie=pcie-gen3-x16`` changed nothing, the profile's 55.96 GB/s won over the link)."""

from __future__ import annotations

import pytest

from hardware_models import presets
from simulator.api import run_warnings
from simulator.config.loader import ScenarioError, load_scenario, resolve_hardware
from tests.conftest import ROOT

OFFLOAD = ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml"  # names pcie-gen5-x16-h200-measured itself
GPU_ONLY = ROOT / "scenarios/h200/gpt_184m_b16.yaml"


def _link(name):
    return presets.get("links", name)


@pytest.mark.parametrize("link", ["pcie-gen3-x16", "pcie-gen4-x16", "pcie-gen5-x16"])
def test_an_explicit_link_replaces_the_profiles_measured_pinned_rates(link):
    hw = resolve_hardware(load_scenario(OFFLOAD, [f"hardware.pcie={link}"]))
    bw = _link(link).bandwidth_bytes_per_s  # 15.75 / 31.5 / 63 GB/s (PCIe base specifications)
    assert (hw.copy.h2d_bytes_per_s, hw.copy.d2h_bytes_per_s) == (bw, bw)
    assert hw.copy.duplex_bytes_per_s == _link(link).duplex_bandwidth_bytes_per_s
    # the presets state no pageable staging cap (0): the host's measured driver cap stays
    assert hw.copy.pageable_h2d_bytes_per_s == hw.profile.pageable_h2d_bytes_per_s > 0
    note = [w for w in run_warnings(hw, None) if w.startswith("hardware.pcie")]
    assert len(note) == 1 and f"55.96 -> {bw / 1e9:.2f} GB/s" in note[0], note


def test_the_link_the_profile_was_measured_over_keeps_the_measured_rates():
    hw = resolve_hardware(load_scenario(OFFLOAD))  # the file names pcie-gen5-x16-h200-measured = profile.copy_link
    assert hw.profile.copy_link == "pcie-gen5-x16-h200-measured" and not hw.pcie_explicit
    assert hw.copy.h2d_bytes_per_s == hw.profile.h2d_bytes_per_s
    assert not [w for w in run_warnings(hw, None) if w.startswith("hardware.pcie")]


def test_without_an_explicit_link_the_measured_rates_stay(tmp_path):
    text = "".join(line for line in GPU_ONLY.read_text().splitlines(True) if not line.strip().startswith("pcie:"))
    (tmp_path / "s.yaml").write_text(text)
    cfg = load_scenario(tmp_path / "s.yaml")
    assert "pcie" not in cfg.hardware.model_fields_set
    hw = resolve_hardware(cfg)
    assert hw.copy.h2d_bytes_per_s == hw.profile.h2d_bytes_per_s != _link("pcie-gen5-x16").bandwidth_bytes_per_s


def test_gen3_slows_the_parameter_upload_on_h200_as_on_h100():
    from simulator.api import run_scenario

    def upload(path, sets):
        r = run_scenario(load_scenario(path, ["run.steps=2", "run.warmup_steps=1"] + sets))
        return r.steps.loc[~r.steps.warmup, "step_time_s"].mean()
    # the 0.37 GB bf16 parameter upload alone goes from 6.9 ms (55.96 GB/s) to 23.9 ms (15.75 GB/s): +4% of 389 ms
    assert upload(OFFLOAD, ["hardware.pcie=pcie-gen3-x16"]) > upload(OFFLOAD, []) * 1.03


@pytest.mark.parametrize("link", ["ethernet-100g", "nvlink4", "infiniband-ndr-400g"])
def test_a_network_link_is_refused_as_the_pcie_link(link):
    with pytest.raises(ScenarioError, match=r"hardware\.pcie: .* is not a PCIe link.*allowed: the pcie-\* presets"):
        resolve_hardware(load_scenario(GPU_ONLY, [f"hardware.pcie={link}"]))


def test_overriding_one_field_of_the_measured_link_changes_only_that_field():
    """``hardware.pcie.overrides.latency_s`` on the link the profile was measured over: only the latency changes;
    the measured pinned (55.96 / 57.22 GB/s), duplex and pageable rates stay (they were all replaced by the preset's
    rounded 53.8 GB/s and 6.63 / 13.9 GB/s pageable: the override of one field dropped every measured rate)."""
    base = resolve_hardware(load_scenario(OFFLOAD)).copy
    ref = "hardware.pcie={preset: pcie-gen5-x16-h200-measured, overrides: {latency_s: 40 us}}"
    hw = resolve_hardware(load_scenario(OFFLOAD, [ref]))
    assert hw.copy.latency_s == pytest.approx(40e-6, rel=1e-12)
    assert hw.copy._replace(latency_s=0.0, sources={}) == base._replace(latency_s=0.0, sources={})
    assert hw.copy.sources["latency_s"] == "link" and hw.copy.sources["h2d_bytes_per_s"] == "profile"
    assert not [w for w in run_warnings(hw, None) if w.startswith("hardware.pcie")]


def test_overriding_the_measured_links_bandwidth_keeps_its_pageable_caps_and_scales_duplex():
    """A bandwidth override replaces both pinned directions; the measured duplex keeps its efficiency against the
    two directions' sum (95.67 / (55.96 + 57.22) of 2 x 64 GB/s), the pageable driver caps (host-side) stay."""
    p = resolve_hardware(load_scenario(OFFLOAD)).profile
    ref = "hardware.pcie={preset: pcie-gen5-x16-h200-measured, overrides: {bandwidth_bytes_per_s: 64 GB/s}}"
    hw = resolve_hardware(load_scenario(OFFLOAD, [ref]))
    c = hw.copy
    assert (c.h2d_bytes_per_s, c.d2h_bytes_per_s) == (64e9, 64e9)
    want = p.duplex_bytes_per_s * 128e9 / (p.h2d_bytes_per_s + p.d2h_bytes_per_s)
    assert c.duplex_bytes_per_s == pytest.approx(want, rel=1e-12)
    assert (c.pageable_h2d_bytes_per_s, c.pageable_d2h_bytes_per_s, c.latency_s) == (
        p.pageable_h2d_bytes_per_s, p.pageable_d2h_bytes_per_s, p.copy_latency_s)
    note = [w for w in run_warnings(hw, None) if w.startswith("hardware.pcie")]
    assert len(note) == 1 and "55.96 -> 64.00 GB/s" in note[0], note


def test_a_link_in_a_run_without_host_copies_says_it_has_no_effect():
    """gpt_184m_b8 copies only its input batch (8 x 1024 int64 tokens and labels = 131,072 B per step): an explicit
    gen3 link leaves its step time as it is, and the run says so (it used to say only that the rates replace the
    measured ones)."""
    from simulator.api import run_scenario

    path = ROOT / "scenarios/h200/gpt_184m_b8.yaml"
    sets = ["run.steps=2", "run.warmup_steps=1"]
    base, gen3 = (run_scenario(load_scenario(path, sets + extra)) for extra in ([], ["hardware.pcie=pcie-gen3-x16"]))
    assert gen3.summary["step_time_s"] == base.summary["step_time_s"]
    note = [w for w in gen3.summary["warnings"] if w.startswith("hardware.pcie")]
    assert note == ["hardware.pcie PCIe Gen3 x16: no effect in this run beyond its input-batch copy (131.1 kB per "
                    "step): the link's rates price only host<->GPU copies, and this step makes no other (no "
                    "optimizer, parameter or activation offload)"], note


def test_a_link_in_an_offload_run_still_names_the_replaced_rates():
    from simulator.api import host_copy_bytes, build_graph, apply_graph_policies

    cfg = load_scenario(OFFLOAD, ["hardware.pcie=pcie-gen3-x16"])
    hw = resolve_hardware(cfg)
    copies = host_copy_bytes([apply_graph_policies(build_graph(cfg, 0, hw), cfg, hw)])
    assert copies[1] > 0.37e9  # the bf16 parameter upload alone
    note = [w for w in run_warnings(hw, cfg, copies) if w.startswith("hardware.pcie")]
    assert len(note) == 1 and "55.96 -> 15.75 GB/s" in note[0], note
