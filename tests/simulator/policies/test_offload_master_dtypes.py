"""DeepSpeed's low-precision master weights / optimizer states under ZeRO-Offload (``fp16.fp16_master_weights_and_grads``,
``bf16.bf16_master_weights_and_grads``, ``bf16.bf16_optimizer_states``; simulator/config/sections/half_precision.py):
bytes per parameter the CPUAdam kernel streams, the CPU step at a given bandwidth, host memory, and DeepSpeed's rules.

Worked by hand on the round host of tests/hardware_models/test_host_kernels.py (2 sockets x 4 cores, 32 GB/s sustained
over both nodes, 5 GB/s per core, 64e9 vector slots/s), one tensor of 1e9 parameters in pageable memory (both nodes:
32 GB/s), 1 ms per dispatch:

* fp32 master, fp32 moments (before): no host cast (current DeepSpeed casts the gradients on the GPU and copies them
  in fp32); the kernel 16 B read + 12 B written + the 2 B half copy = 30 B -> 0.9385 s.
* bf16 (or fp16) master, fp32 moments: no cast; the kernel reads param 2 + grad 2 + moments 8, writes param 2 +
  moments 8 = 22 B -> 0.6885 s.
* bf16 master, bf16 moments: 2 + 2 + 4 read, 2 + 4 written = 14 B -> 0.4385 s (19 vector slots / 64e9 = 0.297 s:
  still memory-bound).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hardware_models.host_kernels import adamw_passes, adamw_step_s
from simulator import load_scenario, run_scenario
from simulator.config.errors import ScenarioError
from simulator.policies.offload_optimizer import cpu_step_times
from tests.conftest import ROOT
from tests.hardware_models.test_host_kernels import ROUND

ONE_GPU = str(ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml")
DS = "zero_optimization.offload_optimizer.cpu_adam_impl=deepspeed_cpu_adam"
BF16_MASTER = "bf16.bf16_master_weights_and_grads=true"
BF16_STATES = "bf16.bf16_optimizer_states=true"
#: parameters of the 184M GPT of that scenario (its builder's param_groups)
P = 185_759_744


def test_kernel_bytes_per_parameter_by_hand():
    assert sum(p.bytes for p in adamw_passes("deepspeed_cpu_adam")) == 30
    assert sum(p.bytes for p in adamw_passes("deepspeed_cpu_adam", 4, 2, 0, param_bytes=2)) == 22
    assert sum(p.bytes for p in adamw_passes("deepspeed_cpu_adam", 2, 2, 0, param_bytes=2)) == 14
    # at 32 GB/s: 1e9 x 22 B = 0.6875 s, 1e9 x 14 B = 0.4375 s
    assert adamw_step_s(ROUND, "deepspeed_cpu_adam", [1e9], state_bytes=2, grad_bytes=2, copy_bytes=0,
                        param_bytes=2) == pytest.approx(0.4375)
    with pytest.raises(ValueError, match="deepspeed_cpu_adam only"):
        adamw_passes("torch_fused", param_bytes=2)


def test_cpu_step_at_a_given_bandwidth_by_hand():
    hw = SimpleNamespace(host_cpu=ROUND, launch=SimpleNamespace(per_op_s=1e-3))

    def step(**kw):
        return cpu_step_times(10**9, 1, "deepspeed_cpu_adam", hw, pin_memory=False, **kw)

    fp32 = step()
    assert fp32["cpu.grad_cast"] == 0.0
    assert fp32["cpu.adam"] == pytest.approx(30e9 / 32e9 + 1e-3)
    low = step(master_bytes=2)
    assert low == pytest.approx({"cpu.grad_cast": 0.0, "cpu.adam": 22e9 / 32e9 + 1e-3, "cpu.param_cast": 0.0})
    both = step(master_bytes=2, state_bytes=2)
    assert both["cpu.adam"] == pytest.approx(0.4385)
    with pytest.raises(Exception, match="need deepspeed_cpu_adam"):
        cpu_step_times(10**9, 1, "torch_foreach", hw, master_bytes=2)


def _run(*sets: str) -> dict:
    return run_scenario(load_scenario(ONE_GPU, ["run.steps=2", "run.warmup_steps=1", DS, *sets])).summary


def test_host_memory_and_copies_per_dtype():
    """Host bytes per parameter: fp32 master 4 + moments 8 + fp32 gradient partition 4 (current DeepSpeed copies
    the gradients cast to fp32 on the GPU) + parameter staging 2 = 18 B pinned, nothing pageable; bf16 master 2 +
    moments 8 + its gradient partition 2 = 12 B; bf16 moments too: 2 + 4 + 2 = 8 B. The GPU's persistent side (16-bit
    weights and gradients) does not change."""
    fp32, master, states = _run(), _run(BF16_MASTER), _run(BF16_MASTER, BF16_STATES)
    assert (fp32["peak_host_pinned_bytes"], fp32["peak_host_pageable_bytes"]) == (18 * P, 0)
    assert (master["peak_host_pinned_bytes"], master["peak_host_pageable_bytes"]) == (12 * P, 0)
    assert (states["peak_host_pinned_bytes"], states["peak_host_pageable_bytes"]) == (8 * P, 0)
    assert fp32["peak_memory_bytes"] == master["peak_memory_bytes"] == states["peak_memory_bytes"]
    # the CPU step shrinks with the bytes it streams (30 -> 22 -> 14 B per parameter on this memory-bound host)
    assert fp32["offload_cpu_optimizer_s"] > master["offload_cpu_optimizer_s"] > states["offload_cpu_optimizer_s"]
    assert states["step_time_s"] < fp32["step_time_s"]
    # what the pricing assumes is said in the run's warnings (none with fp32 state)
    assert [w for w in states["warnings"] if "master weights and gradients on the host" in w] == [
        "bf16 master weights and gradients on the host with bf16 Adam moments: DeepSpeedCPUAdam built with "
        "fp32_optimizer_states=False (its optimizer.params), which DeepSpeed requires here; the CPU step is priced on "
        "the bytes DeepSpeedCPUAdam streams (14 B per parameter), not on its 16-bit conversions in registers "
        "(memory-bound); the gradient partition's norm and (fp16) loss-scale unscale on the host are not priced, as "
        "with fp32 master weights"]
    assert not [w for w in fp32["warnings"] if "master weights and gradients on the host" in w]


def test_fp16_master_with_fp16_training():
    s = _run("training.precision=fp16", "fp16.fp16_master_weights_and_grads=true")
    assert (s["peak_host_pinned_bytes"], s["peak_host_pageable_bytes"]) == (12 * P, 0)


@pytest.mark.parametrize("sets, match", [
    ((BF16_STATES,), "bf16_optimizer_states requires bf16_master_weights_and_grads to be enabled"),
    ((BF16_MASTER, "zero_optimization.offload_optimizer.cpu_adam_impl=torch_foreach"),
     "Master weights feature requires ZeRO-2 Offload with DeepSpeedCPUAdam"),
    ((BF16_MASTER, "zero_optimization.offload_optimizer.cpu_adam_impl=deepspeed_cpu_adam_2020"),
     "DeepSpeed 0.3's kernel takes fp32 only"),
    ((BF16_MASTER, "zero_optimization.offload_optimizer.device=none"),
     "Master weights feature requires ZeRO-2 Offload with DeepSpeedCPUAdam"),
    ((BF16_MASTER, BF16_STATES, "zero_optimization.offload_optimizer.device=none"), "kept on the GPU .* not modelled"),
    (("fp16.fp16_master_weights_and_grads=true",), "needs training.precision fp16"),
    (("bf16.enabled=true", "training.precision=fp16"), "bf16.enabled: true is training.precision: bf16 here"),
    ((BF16_MASTER, "zero_optimization.stage=0", "zero_optimization.offload_optimizer.device=none"),
     "only supported with ZeRO Stage 1, 2, or 3"),
    (("fp16.loss_scale=0",), "fp16 loss-scaling keys are read with training.precision fp16"),
])
def test_deepspeeds_rules_are_refused_in_one_line(sets, match):
    with pytest.raises(ScenarioError, match=match) as e:
        load_scenario(ONE_GPU, [DS, *sets])
    assert "\n" not in str(e.value)
