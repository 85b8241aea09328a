"""An unknown preset name beside other problems is told in the same run (``preset_names``, ``loader.scenario_errors``),
in the line ``resolve_hardware`` gives it alone; and a value breaking several rules of one check gets a line per
rule (``errors.refuse_each``). Through the CLI: ``simulate run FILE --set ...`` in a subprocess."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT

TP2 = "scenarios/cluster/gpt_1p3b_dgx_h100_tp2_dp4.yaml"
H200 = "scenarios/h200/gpt_184m_b8.yaml"


def cli(scenario: str, *sets: str, cwd=ROOT) -> tuple[int, list[str]]:
    """``simulate run SCENARIO --set S ...``: exit status and its stderr lines (``--set`` marks removed)."""
    args = [a for s in sets for a in ("--set", s)]
    r = subprocess.run([sys.executable, "-m", "simulator.cli", "run", scenario, *args], capture_output=True,
                       text=True, cwd=cwd, timeout=120)
    return r.returncode, [line.split(" (from the command line")[0] for line in r.stderr.splitlines()]


@pytest.mark.parametrize("key, name, line", [
    ("hardware.cluster.preset", "dgx-h10", "hardware.cluster.preset: unknown cluster preset 'dgx-h10'; known: "
     "4x-a100-pcie, 4x-a100-pcie-nvlink, dgx-a100, dgx-h100, dgx-h200, h100-pcie-8gpu; did you mean 'dgx-h100' or "
     "'dgx-h200' or 'dgx-a100'?"),
    ("hardware.gpu", "h100-sxm-80g", "hardware.gpu: unknown gpu preset 'h100-sxm-80g'; known: a100-pcie-80gb, "
     "a100-sxm4-40gb, a100-sxm4-80gb, a40-48gb, b200-180gb, h100-sxm-80gb, h200-sxm-141gb, mi210-64gb, "
     "mi300x-192gb, rtx-2080-ti-11gb, titan-rtx-24gb, v100-sxm2-16gb, v100-sxm2-32gb; did you mean 'h100-sxm-80gb' or "
     "'a100-sxm4-80gb' or 'a100-sxm4-40gb'?"),
    ("hardware.host", "dgx-h100-hots", "hardware.host: unknown host preset 'dgx-h100-hots'"),
    ("hardware.pcie", "nvlink4", "hardware.pcie: 'nvlink4' is not a PCIe link (the GPU's host link); allowed: the "
     "pcie-* presets (simulate presets --family links); a network goes in hardware.cluster"),
    ("hardware.profile", "h100-sxm", "hardware.profile: unknown profile preset 'h100-sxm'"),
    ("hardware.cluster.network", "ib-ndr", "hardware.cluster.network: unknown network preset 'ib-ndr'"),
    ("hardware.cluster.collective_profile", "dgx-h10", "hardware.cluster.collective_profile: unknown collective "
     "preset 'dgx-h10'"),
])
def test_an_unknown_preset_is_told_beside_the_other_problems(key, name, line):
    """Found at hardware resolution before: the misspelt key's line alone, the preset's only once it was fixed."""
    rc, alone = cli(TP2, f"{key}={name}")
    assert rc == 2 and len(alone) == 1 and alone[0].startswith(f"error: {TP2}: {line}")
    rc, lines = cli(TP2, f"{key}={name}", "model.zz_not_a_key=1", "training.micro_batch_size=-8")
    assert rc == 2 and len(lines) == 3, lines
    assert lines[0].startswith(f"error: {TP2}: model.zz_not_a_key: unknown key")
    assert alone[0] in lines  # the same line as when it is the file's only problem
    assert f"error: {TP2}: training.micro_batch_size: Input should be greater than 0 (got -8)" in lines


def test_an_unknown_preset_in_a_mapping_names_its_preset_key():
    rc, lines = cli(TP2, "hardware.gpu.preset=h100-sxm-80g", "model.zz_not_a_key=1")
    assert rc == 2 and len(lines) == 2 and lines[1].startswith(f"error: {TP2}: hardware.gpu.preset: unknown gpu preset")
    rc, alone = cli(TP2, "hardware.gpu.preset=h100-sxm-80g")
    assert alone == [lines[1]]


def test_an_unknown_cluster_is_not_taken_for_one_gpu():
    """With the cluster unknown its world size is unknown: the checks reading it (gbs a multiple of mbs x dp, a
    dp_rank below dp) are skipped; before they ran on data_parallel_size 1 and refused a valid file with a wrong
    number, hiding the unknown preset."""
    rc, lines = cli(TP2, "hardware.cluster.preset=dgx-h10", "training.global_batch_size=32")
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"error: {TP2}: hardware.cluster.preset: unknown")
    rc, lines = cli(TP2, "hardware.cluster.preset=dgx-h10", "rank_overrides=[{dp_rank: 2, slowdown: 1.2}]")
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"error: {TP2}: hardware.cluster.preset: unknown")


def test_a_dp_rank_outside_one_replica_is_told_in_replicas():
    """dp 1 = pp 1: the words were chosen by comparing the bound with pp ("outside the 1 pipeline stages")."""
    rc, lines = cli(H200, "hardware.cluster={preset: dgx-h100, nodes: 1}", "hardware.gpu=h100-sxm-80gb",
                    "parallelism.tensor_model_parallel_size=8", "rank_overrides=[{dp_rank: 1, slowdown: 1.2}]")
    assert rc == 2 and f"error: {H200}: rank_overrides[0].dp_rank: 1 is outside the 1 data-parallel replicas " \
        "(allowed: 0..0)" in lines, lines


def test_a_tensor_parallel_size_breaking_two_rules_gets_both_lines():
    rc, lines = cli(TP2, "parallelism.tensor_model_parallel_size=3")
    rule = f"error: {TP2}: parallelism.tensor_model_parallel_size: 3 must divide"
    assert rc == 2 and lines == [
        f"{rule} the 8 GPUs per node of hardware.cluster 'dgx-h100' (TP ranks are consecutive inside a node; allowed: "
        "a divisor of 8)",
        f"{rule} model.num_attention_heads (16; Megatron splits it over the TP ranks)",
        f"{rule} model.ffn_hidden_size (8192; Megatron splits it over the TP ranks)"]


def test_a_rule_reading_a_bad_value_skips_only_itself():
    """num_query_groups is bad: its rule is skipped, the GPUs-per-node and heads rules of the same check are told."""
    rc, lines = cli(TP2, "parallelism.tensor_model_parallel_size=3", "model.group_query_attention=true",
                    "model.num_query_groups=many")
    rule = f"error: {TP2}: parallelism.tensor_model_parallel_size: 3 must divide"
    assert rc == 2 and len(lines) == 4 and lines[0].startswith(f"error: {TP2}: model.num_query_groups: Input should")
    assert [line.split(" (")[0] for line in lines[1:]] == [
        f"{rule} the 8 GPUs per node of hardware.cluster 'dgx-h100'", f"{rule} model.num_attention_heads",
        f"{rule} model.ffn_hidden_size"]


def test_without_a_cluster_the_tp_size_is_also_checked_against_the_model():
    rc, lines = cli(H200, "parallelism.tensor_model_parallel_size=5")
    assert rc == 2 and len(lines) == 3
    assert lines[0].startswith(f"error: {H200}: parallelism.tensor_model_parallel_size: 5 > 1 needs hardware.cluster")
    assert "5 must divide model.num_attention_heads (16;" in lines[1] and "model.ffn_hidden_size (4096;" in lines[2]


def test_two_unknown_presets_of_a_valid_schema_are_told_together():
    """Found by the fuzz (tests/properties/test_fuzz_bad_keys.py): resolve_hardware stopped at the first name."""
    rc, lines = cli(H200, "hardware.gpu=h100-sxm-80g", "hardware.host=dgx-h100-hots")
    assert rc == 2 and len(lines) == 2
    assert lines[0].startswith(f"error: {H200}: hardware.gpu: unknown gpu preset 'h100-sxm-80g'")
    assert lines[1].startswith(f"error: {H200}: hardware.host: unknown host preset 'dgx-h100-hots'")


def test_a_misspelt_required_model_key_is_told_as_misspelt(tmp_path):
    """Found by the fuzz: the decoder's "seq_length: required key is missing" (a before-validator) hid the
    unknown-key line that says which key was meant."""
    path = tmp_path / "s.yaml"
    path.write_text((ROOT / H200).read_text().replace("seq_length:", "seq_lengthzz:"))
    rc, lines = cli(str(path))
    assert rc == 2 and len(lines) == 1
    assert lines[0].startswith(f"error: {path}: model.seq_lengthzz: unknown key (allowed: ")
    assert lines[0].endswith("did you mean 'seq_length'?")
