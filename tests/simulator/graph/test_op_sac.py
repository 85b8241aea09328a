"""torchtitan's activation checkpointing (``simulator/graph/builders/op_sac.py``,
``simulator/config/sections/torchtitan_ac.py``), worked by hand on the tiny GQA Llama of ``test_llama_features``
with torchtitan's layout (separate wq / wk / wv, repeat_kv): h 64, a 8 heads of d 8, g 2 K/V heads (kv 16),
f 160, b 2, s 16: T = 32 tokens, bf16 (2 B).

Per block, op mode keeps (pytorch/torchtitan@81c12433 torchtitan/models/llama3/infra/parallelize.py ``_save_list``,
every second ``aten.mm`` recomputed; mm order wq, wk, wv, wo, w1, w3, w2): wq out 2 T a d = 4096, wv out 2 T g d =
1024, SDPA out 2 T a d = 4096 and its log-sum-exp 4 b a s = 1024, w1 out 2 T f = 10240, w2 out 2 T h = 4096, beside
the block input 2 T h = 4096: 28672 B. Full recompute keeps the input alone (4096 B); no recompute 68864 B."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator import load_scenario, run_scenario
from simulator.cli import main
from simulator.api import fsdp2_ac_note, fsdp2_selective_note, resolve_hardware, run_warnings, transformer_spec
from simulator.config.errors import ScenarioError
from simulator.graph.builders.transformer import build_gpt_step
from simulator.graph.ops import OpKind, Phase
from simulator.graph.builders import op_sac
from simulator.studies.memory_estimate import stage_memory
from tests.simulator.graph.test_llama_features import T, spec

ROOT = Path(__file__).resolve().parents[3]
TT = dict(qkv_separate=True, repeat_kv=True)


def _kept(g, layer=0) -> list[tuple[str, int]]:
    """(producing kernel, bytes) of the tensors block ``layer``'s forward allocates that a backward op reads."""
    bwd = {u for op in g.ops if op.phase == Phase.BWD for u in op.uses}
    return sorted((op.name, t.nbytes) for op in g.ops if op.phase == Phase.FWD and op.layer == layer
                  for t in op.allocs if t.name in bwd)


def _bytes(g, layer=0) -> int:
    return sum(b for _, b in _kept(g, layer))


def _bwd(g, layer=1, kind=None):
    return [o for o in g.ops if o.layer == layer and o.phase == Phase.BWD and (kind is None or o.kind == kind)]


def test_op_mode_keeps_every_other_mm_by_hand():
    """wq and wv (the QKV GEMM's first and third parts), SDPA's out and lse, w1 (fc1's first half) and w2 are
    kept; wk, wo, w3 are not. Block 0's output (block 1's input) 4096 B is counted too."""
    op, full, none = (build_gpt_step(spec(**TT, recompute=r)) for r in ("op", "full", "none"))
    assert _kept(op) == sorted([("L0.fwd.qkv.gemm", 4096), ("L0.fwd.qkv.gemm", 1024), ("L0.fwd.attn", 4096),
                                ("L0.fwd.attn", 1024), ("L0.fwd.fc1.gemm", 10240), ("L0.fwd.fc2.gemm", 4096),
                                ("L0.fwd.residual2", 4096)])
    assert _bytes(op) == 28672
    assert _bytes(full) == 4096 and _bytes(none) == 68864
    qkv = next(o for o in op.ops if o.name == "L0.fwd.qkv.gemm")
    assert [t.nbytes for t in qkv.allocs] == [2 * T * 64, 2 * T * 16, 2 * T * 16]  # q, k, v apart
    fc1 = next(o for o in op.ops if o.name == "L0.fwd.fc1.gemm")
    assert [t.nbytes for t in fc1.allocs] == [2 * T * 160, 2 * T * 160]  # w1, w3 apart
    k_name = qkv.allocs[1].name
    assert not any(k_name in o.uses for o in op.ops if o.phase == Phase.BWD)  # wk's output is recomputed


def test_op_mode_recompute_kernels_by_hand():
    """Before each block's backward: the three recomputed GEMMs wk (T x 16 x 64: 65536 FLOPs), wo (T x 64 x 64:
    262144) and w3 (T x 160 x 64: 655360), no SDPA forward and no w2; the forward kernels are the same as without
    recompute (the same GEMMs, bytes and FLOPs)."""
    op, none = build_gpt_step(spec(**TT, recompute="op")), build_gpt_step(spec(**TT))
    gemms = [(o.name, o.shape, o.flops) for o in _bwd(op) if o.name.endswith(".gemm")]
    assert gemms == [("L1.bwd.wk.gemm", (T, 16, 64), 65536.0), ("L1.bwd.proj.gemm", (T, 64, 64), 262144.0),
                     ("L1.bwd.w3.gemm", (T, 160, 64), 655360.0)]
    assert not any(o.name == "L1.bwd.attn" for o in _bwd(op))
    fwd = [(o.name, o.flops, o.bytes_read, o.bytes_written) for o in op.ops if o.phase == Phase.FWD]
    assert fwd == [(o.name, o.flops, o.bytes_read, o.bytes_written) for o in none.ops if o.phase == Phase.FWD]
    extra = sum(o.flops for o in op.ops) - sum(o.flops for o in none.ops)
    recomputed = sum(o.flops for o in op.ops if o.phase == Phase.BWD and o.layer >= 0) - sum(
        o.flops for o in none.ops if o.phase == Phase.BWD and o.layer >= 0)
    assert extra == recomputed > 2 * (65536 + 262144 + 655360)  # two blocks' GEMMs + their elementwise kernels


def test_op_mode_under_autocast_recasts_every_weight():
    """amp_fp32_params (fp32 weights, autocast): the recompute casts all seven weights again, h (h + kv) + h kv +
    h h + h f + h f + f h = 64 x 80 + 64 x 16 + 64 x 64 + 3 x 64 x 160 = 40960 elements at 4 B read and 2 B
    written each; with bf16 weights (precision bf16) there is no cast."""
    g = build_gpt_step(spec(**TT, recompute="op", precision="amp_fp32_params"))
    casts = [o for o in _bwd(g) if o.name.endswith(".cast_w")]
    assert [o.name for o in casts] == ["L1.bwd.wq_wv.cast_w", "L1.bwd.wk.cast_w", "L1.bwd.proj.cast_w",
                                       "L1.bwd.w1.cast_w", "L1.bwd.w3.cast_w", "L1.bwd.fc2.cast_w"]
    assert sum(o.bytes_read for o in casts) == 4 * 40960 and sum(o.bytes_written for o in casts) == 2 * 40960
    fwd = [o for o in g.ops if o.layer == 1 and o.phase == Phase.FWD and o.name.endswith(".cast_w")]
    assert sum(o.bytes_read for o in fwd) == 4 * 40960  # the forward casts the same weights once
    assert not any(o.name.endswith(".cast_w") for o in build_gpt_step(spec(**TT, recompute="op")).ops)


def test_op_mode_with_tensor_parallelism_by_hand():
    """t = 2 with sequence parallelism: kept per block wq 2 T 32 = 2048, wv 2 T 8 = 512, SDPA out 2048 and lse
    4 b 4 s = 512, wo's reduce-scatter output 2 (T / 2) 64 = 2048, w1 2 T 80 = 5120, w2 2 T 64 = 4096 and its
    reduce-scatter output 2048, beside the input 2048: 20480 B. The recompute re-runs the two sequence-parallel
    all-gathers (2 T 64 = 4096 B each), not the reduce-scatters."""
    g = build_gpt_step(spec(**TT, recompute="op", tensor_parallel_size=2, sequence_parallel=True))
    assert sorted(b for _, b in _kept(g)) == sorted([2048, 512, 2048, 512, 2048, 5120, 4096, 2048, 2048])
    assert _bytes(g) == 20480
    names = [(o.name, o.meta["collective"], o.meta["bytes"]) for o in _bwd(g, kind=OpKind.COLLECTIVE)]
    assert names[:2] == [("L1.bwd.tp.ln1.all_gather", "all_gather", 4096),
                         ("L1.bwd.tp.ln2.all_gather", "all_gather", 4096)]
    plain = build_gpt_step(spec(**TT, tensor_parallel_size=2, sequence_parallel=True))
    assert len(_bwd(g, kind=OpKind.COLLECTIVE)) == len(_bwd(plain, kind=OpKind.COLLECTIVE)) + 2


def test_every_nth_block_checkpointed_whole():
    """selective_ac_option n: torchtitan's counter (from 1) checkpoints block i when (i + 1) % n == 0: with 4
    blocks and n 2, blocks 1 and 3 re-run their forward in backward and keep only their input; 0 and 2 keep all."""
    g = build_gpt_step(spec(**TT, num_layers=4, recompute="full", recompute_every=2))
    full, none = build_gpt_step(spec(**TT, num_layers=4, recompute="full")), build_gpt_step(spec(**TT, num_layers=4))
    for layer in range(4):
        again = any(o.name == f"L{layer}.bwd.qkv.gemm" for o in g.ops)
        assert again == (layer in (1, 3)), layer
        ref = full if layer in (1, 3) else none
        assert _bytes(g, layer) == _bytes(ref, layer), layer
    with pytest.raises(ValueError, match="recompute_every"):
        spec(recompute="op", recompute_every=2)


F = ROOT / "scenarios/h200/llama3_8b_b1.yaml"
FSDP2 = "fsdp={version: 2}"


def test_config_maps_torchtitan_names():
    """mode full and option 0 / 1 are every block; option n every n-th; op the per-op policy; none none; the
    section's defaults are torchtitan's (selective, "2"); TOML's digit strings are ints."""
    def rec(ac):
        s = transformer_spec(load_scenario(F, [FSDP2, f"activation_checkpoint={ac}"]))
        return s.recompute, s.recompute_every
    assert rec("{mode: full}") == rec("{selective_ac_option: 1}") == rec("{selective_ac_option: 0}") == ("full", 1)
    assert rec("{}") == rec("{mode: selective, selective_ac_option: '2'}") == ("full", 2)
    assert rec("{selective_ac_option: op}") == ("op", 1) and rec("{mode: none}") == ("none", 1)
    assert transformer_spec(load_scenario(F, [FSDP2, "training.recompute_granularity=full"])).recompute == "full"


@pytest.mark.parametrize("overrides, match", [
    (["activation_checkpoint={mode: full}"], "needs fsdp: {version: 2}"),
    ([FSDP2, "activation_checkpoint={mode: full}", "training.recompute_granularity=full"], "both set the recompute"),
    ([FSDP2, "activation_checkpoint={mode: memory_budget}"], "memory_budget .* is torchtitan's but not modelled"),
    ([FSDP2, "activation_checkpoint={selective_ac_option: -1}"], "not a torchtitan selective_ac_option"),
    ([FSDP2, "activation_checkpoint={selective_ac_option: op}", "model.attention_backend=unfused"],
     "op with model.attention_backend unfused is not modelled"),
    ([FSDP2, "activation_checkpoint={mode: full, early_stop: true}"],
     r"^[^\n]*activation_checkpoint.early_stop: true with mode full is not modelled .* allowed: early_stop false"),
    ([FSDP2, "activation_checkpoint={selective_ac_option: 2, early_stop: true}"],
     "activation_checkpoint.early_stop: true with selective_ac_option 2 is not modelled"),
    ([FSDP2, "activation_checkpoint={preserve_rng_state: true}"],
     "activation_checkpoint.preserve_rng_state: true is not modelled .* allowed: false, torchtitan's default"),
    ([FSDP2, "activation_checkpoint={selective_ac_option: op, per_op_sac_force_recompute_mm_shapes_by_fqns: "
             "[attention.wq]}"],
     r"op with activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns \['attention.wq'\] is not "
     "modelled"),
    ([FSDP2, "activation_checkpoint={determinism_check: throw}"], "determinism_check: Input should be 'default' or "
     "'none'"),
    ([FSDP2, "activation_checkpoint={mode: bogus}"], "'bogus' is not a torchtitan activation_checkpoint mode "
     r"\(torchtitan's: none, selective, full, memory_budget; modelled here: none, selective, full\)"),
    ([FSDP2, "activation_checkpoint={mode: memory_budget}"], "torchtitan's modes: none, selective, full, "
     "memory_budget; allowed here: none, selective, full"),
    ([FSDP2, "activation_checkpoint={selective_ac_option: op}", "fsdp.mixed_precision=FULL"],
     r"op with fsdp.mixed_precision FULL \(param_dtype fp32\) is not modelled \(allowed: .*param_dtype bf16"),
    ([FSDP2, "activation_checkpoint={selective_ac_option: op}",
      "fsdp.mixed_precision={param_dtype: fp32, reduce_dtype: fp32}"],
     "op with fsdp.mixed_precision param_dtype fp32 is not modelled"),
    ([FSDP2, "activation_checkpoint={selective_ac_option: 2}", "parallelism.pipeline_model_parallel_size=2"],
     "selective_ac_option: 2 with pipeline_model_parallel_size > 1 is not modelled"),
])
def test_refusals_name_the_key(overrides, match):
    with pytest.raises(ScenarioError, match=match):
        load_scenario(F, overrides)


@pytest.mark.parametrize("ac, key", [("{mode: memory_budget}", "activation_checkpoint.mode: memory_budget"),
                                     ("{mode: bogus}", "activation_checkpoint.mode: 'bogus' is not a torchtitan"),
                                     ("{preserve_rng_state: true}", "activation_checkpoint.preserve_rng_state: true"),
                                     ("{mode: full, early_stop: true}", "activation_checkpoint.early_stop: true")])
def test_unsupported_option_one_line_exit_2(capsys, ac, key):
    """The CLI refuses what is not modelled (or not torchtitan's) in one line naming the key, exit status 2."""
    assert main(["run", str(F), "--set", FSDP2, "--set", f"activation_checkpoint={ac}"]) == 2
    err = capsys.readouterr().err.strip().split("\n")
    assert len(err) == 1 and key in err[0]


@settings(max_examples=12, deadline=None)
@given(layers=st.integers(1, 6), n=st.integers(1, 7))
def test_every_n_keeps_what_each_block_would(layers, n):
    """Invariant: with option n each block keeps exactly what it keeps under full recompute (checkpointed: (i + 1)
    % n == 0) or under none (the others), block by block."""
    g = build_gpt_step(spec(**TT, num_layers=layers, recompute="full", recompute_every=n))
    full = build_gpt_step(spec(**TT, num_layers=layers, recompute="full"))
    none = build_gpt_step(spec(**TT, num_layers=layers))
    for i in range(layers):
        assert _bytes(g, i) == _bytes(full if (i + 1) % n == 0 else none, i), (layers, n, i)


def test_op_mode_runs_between_none_and_full():
    """Simulated (kernel fidelity): op mode's peak memory lies between full recompute's and none's, and so does its
    step time (it re-runs three of seven GEMMs per block, full all seven and the attention). With early_stop true
    the recompute skips each block's second residual add: a shorter step, the same peak (measured on the 2-block
    Llama 3 8B of llama3_8b_b1.yaml, one H200: 0.125678 s against 0.125777 s, the two adds of 49.6 us each, 4 T h
    = 134 MB read and 67 MB written at s 8192)."""
    res = {ac: run_scenario(load_scenario(F, [FSDP2, "run.steps=2", f"activation_checkpoint={ac}"])).summary
           for ac in ("{mode: none}", "{selective_ac_option: op}", "{mode: full}",
                      "{selective_ac_option: op, early_stop: true}")}
    none, op, full, early = res.values()
    assert full["peak_memory_bytes"] < op["peak_memory_bytes"] < none["peak_memory_bytes"]
    assert none["step_time_s"] < op["step_time_s"] < full["step_time_s"]
    assert early["step_time_s"] < op["step_time_s"] and early["peak_memory_bytes"] == op["peak_memory_bytes"]


def test_memory_estimate_reads_the_kept_table_by_hand():
    """The analytic estimate reads the builder's table (``op_sac.KEPT``): op mode saves 28672 B per block, the bytes
    ``test_op_mode_keeps_every_other_mm_by_hand`` counts in the graph; every-2 averages a checkpointed block (its
    input, 4096 B) and a whole one over the model; neither is NotEstimated any more."""
    from simulator.studies.memory_estimate import _layer_activation_bytes, _mean_block_bytes

    op = spec(**TT, recompute="op")
    assert _layer_activation_bytes(op, "op") == 28672
    assert sum(op_sac.kept_bytes(op, 2, 2).values()) == 28672
    every2 = spec(**TT, recompute="full", recompute_every=2)
    assert _mean_block_bytes(every2) == (4096 + _layer_activation_bytes(every2, "none")) / 2
    stage_memory(load_scenario(F, [FSDP2, "activation_checkpoint={selective_ac_option: op}"]))  # no NotEstimated


def test_selective_note_points_to_torchtitan_key():
    """recompute_granularity selective with fsdp.version 2 is still Megatron's, flagged; torchtitan's key is not."""
    cfg = load_scenario(F, [FSDP2, "training.recompute_granularity=selective"])
    note = fsdp2_selective_note(cfg)
    assert note in run_warnings(resolve_hardware(cfg, str(F)), cfg) and "activation_checkpoint" in note
    cfg = load_scenario(F, [FSDP2, "activation_checkpoint={selective_ac_option: op}"])
    assert fsdp2_selective_note(cfg) is None


def test_early_stop_off_reruns_the_second_residual_add_by_hand():
    """torchtitan's default early_stop false: the recompute runs the block's forward to its end, so beside the
    early-stop recompute it re-runs the second residual add h + w2's output over [T, h]: reads (2 + 2) T h = 8192 B,
    writes 2 T h = 4096 B, one kernel more per block and nothing else; it is w2's stored output's last reader
    (freed there), where with early stop the output stays held to the block's last backward kernel. With t = 2
    and sequence parallelism it reads x2 and the reduce-scatter output over [T / 2, h]: 4096 B in, 2048 B out,
    releasing w2's output and its reduce-scatter output."""
    for kw, reads, writes in (({}, 8192, 4096), (dict(tensor_parallel_size=2, sequence_parallel=True), 4096, 2048)):
        off, on = (build_gpt_step(spec(**TT, recompute="op", recompute_early_stop=es, **kw)) for es in (False, True))
        assert [o.name for o in _bwd(off) if o.name not in {p.name for p in _bwd(on)}] == ["L1.bwd.residual2"]
        assert len(_bwd(off)) == len(_bwd(on)) + 1
        add = next(o for o in _bwd(off) if o.name == "L1.bwd.residual2")
        assert (add.bytes_read, add.bytes_written, [t.nbytes for t in add.allocs]) == (reads, writes, [writes])
        names = [o.name for o in _bwd(off)]
        assert names[names.index("L1.bwd.residual2") - 1] == "L1.bwd.swiglu"  # after w3 and the SwiGLU product
        w2 = next(o for o in off.ops if o.name == "L1.fwd.fc2.gemm").allocs[0].name
        assert [o.name for o in _bwd(off) if w2 in o.uses] == ["L1.bwd.residual2"]
        w2 = next(o for o in on.ops if o.name == "L1.fwd.fc2.gemm").allocs[0].name
        assert [o.name for o in _bwd(on) if w2 in o.uses] == ["L1.bwd.residual1.grad"]
    with pytest.raises(ValueError, match="recompute_early_stop is modelled with recompute op only"):
        spec(**TT, recompute="full", recompute_early_stop=True)


#: torchtitan's [activation_checkpoint] as its job config writes it out, every key at its default (a later revision
#: of torchtitan/config/job_config.py ActivationCheckpoint)
TORCHTITAN_DEFAULTS = ("{mode: selective, selective_ac_option: '2', per_op_sac_force_recompute_mm_shapes_by_fqns: "
                       "[moe.router.gate], early_stop: false, memory_budget: 0.5, visualize_memory_budget_pareto: "
                       "false, preserve_rng_state: false, determinism_check: default, debug: false}")


def _ac_warnings(ac: str) -> list[str]:
    cfg = load_scenario(F, [FSDP2, f"activation_checkpoint={ac}"])
    return [w for w in run_warnings(resolve_hardware(cfg, str(F)), cfg) if "activation_checkpoint" in w]


def test_torchtitan_defaults_pasted_are_accepted_silently():
    """Every key of torchtitan's section at its default: accepted, no warning, the same build as the empty section
    (every 2nd block checkpointed, no early stop)."""
    pasted = transformer_spec(load_scenario(F, [FSDP2, f"activation_checkpoint={TORCHTITAN_DEFAULTS}"]))
    empty = transformer_spec(load_scenario(F, [FSDP2, "activation_checkpoint={}"]))
    assert pasted == empty and (pasted.recompute, pasted.recompute_every, pasted.recompute_early_stop) == (
        "full", 2, False)
    assert _ac_warnings(TORCHTITAN_DEFAULTS) == []
    op = TORCHTITAN_DEFAULTS.replace("'2'", "op")
    assert _ac_warnings(op) == [] and transformer_spec(load_scenario(F, [FSDP2, f"activation_checkpoint={op}"])
                                                       ).recompute == "op"


def test_early_stop_maps_to_the_op_recompute_only():
    """early_stop reaches the builder with the op option; with mode none (no block wrapped) it is warned."""
    def es(ac):
        return transformer_spec(load_scenario(F, [FSDP2, f"activation_checkpoint={ac}"])).recompute_early_stop
    assert es("{selective_ac_option: op}") is False and es("{selective_ac_option: op, early_stop: true}") is True
    assert es("{mode: none, early_stop: true}") is False
    assert _ac_warnings("{mode: none, early_stop: true}") == [
        "activation_checkpoint.early_stop has no effect: no block is checkpointed; the run is the same without it"]


@pytest.mark.parametrize("ac, line", [
    ("{debug: true}", "activation_checkpoint.debug true: torch's operator logs of forward and recompute are host-side "
                      "and not priced; the run is the same without it"),
    ("{determinism_check: none}", "activation_checkpoint.determinism_check none: torch's check of the recomputed "
                                  "tensors' metadata is host-side and not priced; the run is the same without it"),
    ("{visualize_memory_budget_pareto: true, memory_budget: 0.3}",
     "activation_checkpoint.memory_budget, visualize_memory_budget_pareto have no effect with mode selective (read "
     "only with mode memory_budget); the run is the same without them"),
    ("{mode: full, per_op_sac_force_recompute_mm_shapes_by_fqns: [attention.wq]}",
     "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns ['attention.wq'] has no effect (read only "
     "with selective_ac_option op); the run is the same without it"),
    ("{selective_ac_option: op, per_op_sac_force_recompute_mm_shapes_by_fqns: []}",
     "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns [] has no effect (like its default "
     "['moe.router.gate'], it names no Linear of the dense Llama block); the run is the same without it"),
    ("{mode: none, preserve_rng_state: true, debug: true}",
     "activation_checkpoint.preserve_rng_state, debug have no effect: no block is checkpointed; the run is the same "
     "without them"),
])
def test_keys_without_effect_are_warned_in_one_line(ac, line):
    assert _ac_warnings(ac) == [line]


def test_fsdp2_without_the_section_says_what_it_priced():
    """fsdp.version 2 without activation_checkpoint prices training.recompute_granularity, not torchtitan's default
    (every 2nd block), and says so; with the section, selective granularity (its own note) or FSDP1: no line."""
    def note(*over):
        return fsdp2_ac_note(load_scenario(F, list(over)))
    cfg = load_scenario(F, [FSDP2])
    assert transformer_spec(cfg).recompute == "none"
    line = note(FSDP2)
    assert line in run_warnings(resolve_hardware(cfg, str(F)), cfg)
    assert line.startswith("fsdp.version 2 without an activation_checkpoint section: priced with no activation "
                           "checkpointing (training.recompute_granularity unset); torchtitan's default job config "
                           "checkpoints every 2nd block")
    assert "every block checkpointed whole" in note(FSDP2, "training.recompute_granularity=full")
    assert note(FSDP2, "training.recompute_granularity=selective") is None
    assert note(FSDP2, "activation_checkpoint={mode: none}") is None and note() is None
