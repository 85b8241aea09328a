"""The norms' fp32 statistics and the flash kernel's log-sum-exp are saved for backward: each is read by its
backward kernel, so it lives until then, and the simulated peak matches the memory estimate that counts them."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator import load_scenario, run_scenario
from simulator.api import transformer_spec
from simulator.graph.builders.transformer import build_gpt_step
from simulator.studies.memory_estimate import estimate_memory, flash_lse_bytes, norm_stats_bytes
from tests.simulator.graph.test_llama_features import T, spec

ROOT = Path(__file__).resolve().parents[3]


def _alloc(g, stem: str, producer: str):
    """``(tensor name, bytes)`` of the tensor named ``stem#...`` that op ``producer`` allocates."""
    op = next(o for o in g.ops if o.name == producer)
    return next((t.name, t.nbytes) for t in op.allocs if t.name.startswith(stem + "#"))


def test_statistics_are_read_by_their_backward_by_hand():
    """Tiny Llama (b 2, s 16, 8 heads, RMSNorm): each norm keeps fp32 rstd, 4 B x T = 128 B, read by its dgrad and
    dgamma kernels; the flash forward keeps the fp32 log-sum-exp, 4 B x b a s = 4 x 2 x 8 x 16 = 1024 B, read by the
    flash backward; the final norm's statistics by ``ln_f.dgrad``."""
    g = build_gpt_step(spec())
    users = {}
    for op in g.ops:
        for u in op.uses:
            users.setdefault(u, []).append(op.name)
    for layer in (0, 1):
        for norm in ("ln1", "ln2"):
            name, nbytes = _alloc(g, f"{norm}.stats", f"L{layer}.fwd.{norm}")
            assert nbytes == 4 * T == 128
            assert users[name] == [f"L{layer}.bwd.{norm}.dgrad", f"L{layer}.bwd.{norm}.dgamma"]
        name, nbytes = _alloc(g, "attn.lse", f"L{layer}.fwd.attn")
        assert nbytes == 4 * 2 * 8 * 16 == 1024
        assert users[name] == [f"L{layer}.bwd.attn.dgrad"]
    name, nbytes = _alloc(g, "ln_f.stats", "fwd.ln_f")
    assert nbytes == 128 and users[name] == ["bwd.ln_f.dgrad", "bwd.ln_f.dgamma"]


def test_selective_recompute_writes_the_lse_again():
    """Selective recompute keeps no log-sum-exp: the forward's is read by nothing (freed when the kernel ends), the
    recomputed forward writes it again (1024 B more written) and the backward reads that one."""
    g = build_gpt_step(spec(recompute="selective"))
    name, _ = _alloc(g, "attn.lse", "L0.fwd.attn")
    assert not any(name in o.uses for o in g.ops)
    rec = next(o for o in g.ops if o.name == "L0.bwd.attn.recompute")
    name, nbytes = next((t.name, t.nbytes) for t in rec.allocs if t.name.startswith("attn.lse.recomputed#"))
    assert nbytes == 1024 and rec.bytes_written == 2 * T * 64 + 1024
    assert name in next(o for o in g.ops if o.name == "L0.bwd.attn.dgrad").uses


def test_llama3_8b_peak_is_the_estimate_with_the_statistics():
    """Llama-3.1-8B shapes, 2 layers, s 8192, b 1, one H200: per block 2 x 32 KiB of RMSNorm rstd (4 B x 8192) and
    1 MiB of log-sum-exp (4 B x 32 heads x 8192), the final norm's 32 KiB: the simulated peak equals the estimate
    (before, the simulation freed them at once: 2.26 MB below, and the estimate lacked the log-sum-exp)."""
    cfg = load_scenario(ROOT / "scenarios/h200/llama3_8b_b1.yaml", ["run.steps=2", "run.warmup_steps=1"])
    s = transformer_spec(cfg)
    assert norm_stats_bytes(s) == 4 * 8192 and flash_lse_bytes(s, "none") == 4 * 32 * 8192
    assert flash_lse_bytes(s, "selective") == 0
    sim = run_scenario(cfg).summary["peak_device_memory_bytes"]
    assert estimate_memory(cfg).peak_device_bytes == pytest.approx(sim, rel=1e-12)
