"""Predicted vs measured: ZeRO-Offload on the H200 host, and the ZeRO-Offload tutorial case.

Measured: tests/data/h200/measurements.json ``offload.gpt_184m_b16_offload_overlap`` (median of 6
steps; notes.offload) and tests/data/paper/zerooffload_gpt2_10b_v100.yaml (DeepSpeed tutorial log).
The CPU step is the host roofline of hardware_models.host_kernels: per pass max(bytes / sustained
bandwidth, vector slots / SIMD throughput) + first-touch page faults + per-tensor dispatch. Its
two free parameters (the H200 host's ``stream_bandwidth_bytes_per_s`` = 98.11 GB/s and
``page_fault_s`` = 6.18 us) are fitted by scripts/fit_host_cpu_model.py on the single-tensor
``micro.cpu_adam`` points only: nothing is fitted to the runs below (out of sample). The DGX-2
host of the 10B case is priced from its datasheet alone. Errors (predicted / measured - 1):

    H200 overlap   step -14.4%   gpu_fwd_bwd +8.3%   cpu_adam -21.7%   h2d -5.9%
    (before: fitted constants, first-touch bandwidth in-sample: step -12.8%, cpu_adam -20.0%)
    V100 10B       step -13.8%   fwd -19.6%   bwd +3.0%   optimizer -38.5%   CPU Adam -37.1%
    (before the fresh checkpoint buffers' first-touch faults, the Volta hosts' published pageable rates and the
    scalar __half conversion: step -24.6%, fwd -49.8%, bwd -2.0%, optimizer -42.5%, CPU Adam -42.0%)
    (before DeepSpeed 0.3's stage2.py gradient path (fp32 D2H copies the training thread blocks on, per-bucket GPU
    passes), its optimizer_gradients unscale on the CPU, no CPU gradient cast, and the host DRAM shared with the
    tile copies: step -37.7%, bwd -27.0%, optimizer -47.3%, CPU Adam -35.3%)
    (before the run's unfused attention and DeepSpeed's blocking cpu_checkpointing copies were modelled:
    step -39.8%, fwd -57.5%, bwd -34.2%)
    (before: step -47.0%, optimizer -60%, CPU Adam 1.79 s against 6.35 s, -72%)

Held-back modes (no measurement): serial 0.397 s per step, DPU 0.341 s per step with a CPU step
of 0.341 s against 0.330 s in overlap/serial (DPU: the training thread takes one of the 16 cores
from the intra-op pool, and its gradient copies share the host DRAM with the CPU Adam: 0.339 s before
that was modelled). Serial and overlap get the same CPU time: nothing runs beside the CPU step in
either mode, in the model and in the overlap run's trace (the gradient copies end at 51 ms, the CPU step
runs 51-419 ms, the parameter upload 427-434 ms of ProfilerStep#2), so the host DRAM the DMA takes does
not reach it (the measured difference is not explained).

Known misses (strict xfail, so that a fix shows up):

* H200 cpu_adam (and so step): two errors that partly cancel. scripts/trace_cpu_step_passes.py prints, per
  pass, the run's Kineto trace (tests/data/h200/trace_gpt_184m_b16_offload_overlap, both ProfilerSteps, main
  thread) raw and "robust" (per tensor size, the median per-tensor op time x the count) against the model,
  ms, error model / robust - 1 (model / raw - 1):

      pass            raw s1/s2    robust s1/s2   model (faults)   err robust (raw)   16 MiB tensor meas/model
      grad cast       46.8/38.7    26.0/24.9      82.8 (70.0)      +226% (+94%)       0.432/0.266
      mul_ (wd)       21.3/18.9    14.3/14.3      16.6             +16% (-18%)        0.288/0.352
      lerp_           31.0/30.2    24.2/23.9      24.1              +0% (-21%)        0.521/0.523
      mul_            17.7/18.1    14.8/15.0      16.6             +11% (-8%)         0.301/0.352
      addcmul_        38.5/31.9    23.1/29.2      24.1              -8% (-31%)        0.493/0.523
      sqrt            70.2/60.4    48.4/47.9      86.6 (70.0)      +80% (+33%)        1.035/0.352 (no faults)
      div_            18.4/24.9    14.5/15.1      16.6             +12% (-24%)        0.296/0.352
      add_            20.4/35.6    17.1/15.0      16.6              +3% (-41%)        0.304/0.352
      addcdiv_        42.0/38.0    34.0/32.3      31.7              -4% (-21%)        0.650/0.694
      param cast+H2D  21.4/33.4    18.0/23.2      12.8             -38% (-53%)        0.179/0.266
      Optimizer.step tail with no op: 26.6/26.2 (model 0).  Totals: raw 355, robust 237, model 328 ms.

  (1) In-place passes: per tensor the fitted 98 GB/s is right (robust -8%..+16%). (2) Fresh outputs: the model
  charges 6.18 us/page (16 threads) on all 181k pages of the sqrt list and of the fp32 gradients (the 743 MB
  total >= 32 MiB rule, ``faulting_elements``); the trace faults selectively: the 128 MiB embedding (an mmap at
  any malloc state) at ~6.5 us/page in sqrt (18.2/14.9 ms vs 3.2 ms unfaulted) and ~2.3 us/page in the grad cast
  (8.8/7.6 ms vs 3.4); the 24 16-MiB sqrt outputs 1.04 ms each vs 0.43 unfaulted (2.2-2.6 us/page if every
  page faults); the 12-MiB and smaller sqrt outputs and all non-embedding grad casts do not fault (time =
  12 B/elem, the fresh line's write-allocate read, which the model does not charge: 8 B). Which heap-sized
  tensors fault depends on glibc's dynamic mmap/trim thresholds and the program's allocation history, not in
  the single-tensor microbenchmark. (3) Not modelled: ~40 stalls in two steps (one per-tensor op 1-11 ms over
  its size's median, 135 ms excess; tiny 1024-element single-threaded ops included, no other traced activity
  overlaps them: a vCPU descheduled, e.g. KVM steal), 55-65 ms per step, plus the 26 ms tail (freeing the sqrt
  list: munmap/trim). Pricing only the trace's faults (mmapped_elements: the embedding alone) would take the
  model to ~215 ms, -49%: not done, the stalls would then be the whole gap and nothing prices them from the
  microbenchmarks. The fit: scripts/fit_host_cpu_model.py solves 2x2 at 192M only; over 64M+192M (4 points,
  least squares) 94.2 GB/s and 5.45 us/page, residuals +8.7%/+48.1% at 64M: at 64M foreach=False is *faster*
  than foreach=True, which no per-page cost gives (16M: the 256 MB working set fits the 300 MiB L3), so
  all-point fits do not help; at 192M the micro's medians may carry the same stalls. To settle: rerun
  micro.cpu_adam over the run's 148 tensor sizes (foreach=True) with perf stat -e minor-faults per op, with
  and without MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ pinned (faults off), /proc/stat steal sampled
  per step, and at torch.set_num_threads(15) (a straggler vCPU shows as stalls vanishing). Not refitted on
  this trace: it is the validation run itself.
* the 10B V100 case: the GPU side has no V100 efficiency profile (generic 70% GEMM efficiency;
  the log's forward runs at ~35 TFLOP/s (2.19e14 FLOP in 6.20 s), the backward with its
  recompute at ~55 (6.6e14 in 12.07 s), the model both at ~83). Its DeepSpeed config
  (DeepSpeedExamples Megatron-LM/scripts/ds_zero-offload_10B_config.json, loss scale 4096 as in the
  log) checkpoints activations to the CPU: the scenario sets cpu_checkpointing (blocking copies into
  pageable memory, 84 MB per layer per direction, at published Volta-host pageable rates: D2H 10.77 GB/s,
  H2D 4.78 GB/s, +0.39 s forward, +0.88 s backward) with ``host_buffers: fresh``: DeepSpeed 0.3 allocates the
  buffers afresh each iteration and the D2H copy faults in their 1.02M 4-KiB pages at the published 1.71 us
  (dgx2-v100-host page_fault_s): +1.75 s forward (partition_activations does nothing at model-parallel size 1). The 2020 Megatron GPT-2 attention
  is unfused (QK^T, scale, mask, softmax, dropout over 10 x 32 x 1024^2 scores per layer): the
  scenario sets attention_backend unfused with Megatron's default dropouts. The CPU Adam step (DeepSpeed
  0.3's CPUAdam, ``deepspeed_cpu_adam_2020``: per 1 Gi-element tile its AVX-512 loop, 28 B/param, then
  a second loop writing fp16 copies, 6 B/param, that cudaMemcpyAsync sends to the GPU while the next
  tile runs, csrc/adam/cpu_adam.cpp ``Adam_Optimizer::Step``; on the inferred DGX-2 host, pinned state
  on one NUMA node: 102 GB/s, each tile's copy-back taking its max-min share of it) predicts 3.68 s
  against 6.35 s logged: the host is inferred (the tutorial does not state it), and DeepSpeed 0.3's
  stage2.py casts the gradients to fp32 on the GPU, so no CPU cast is charged (4.11 s with one). The second
  loop's scalar ``(__half)`` conversions (cuda_fp16 host code, a software conversion per element) at 13.175
  cycles per element (scripts/count_half_convert.py) (hardware_models.host_kernels) take it to 3.99 s. Backward: stage2.py with
  cpu_offload (the tutorial's overlap_comm, DeepSpeed 0.3's default reduce_bucket_size 5e8) runs per
  bucket ``torch.cuda.synchronize()``, then per gradient GPU passes (fp64 norm, fp32 overflow sum, fp32
  cast: 42 B/elem with the ipg copy and ``div_``) and an fp32 D2H copy (4 B/param, 41 GB at 15.75 GB/s)
  the training thread blocks on (``float(x.float().sum())``): backward 12.44 s against 12.07 s. Forward and
  CPU Adam: see KNOWN_GAPS.
"""

from __future__ import annotations

import json

import pytest
import yaml

from simulator import load_scenario, run_scenario
from simulator.studies.validation import ZO_CPU_ADAM_S, ZO_ID, all_cases
from tests.conftest import ROOT
from tests.validation.common import check_rel, known_gap_xfail

pytestmark = pytest.mark.validation

MEASURED = json.loads((ROOT / "tests/data/h200/measurements.json").read_text())["offload"]["gpt_184m_b16_offload_overlap"]
PAPER = yaml.safe_load((ROOT / "tests/data/paper/zerooffload_gpt2_10b_v100.yaml").read_text())


@pytest.fixture(scope="module")
def overlap():
    return run_scenario(load_scenario(ROOT / "scenarios/h200/gpt_184m_b16_offload_overlap.yaml")).summary


@pytest.fixture(scope="module")
def paper():
    return run_scenario(load_scenario(ROOT / "scenarios/validation/ZEROOFFLOAD-GPT2-10B-1xV100-log.yaml")).summary


def _check(what: str, predicted: float, measured: float, tol: float) -> None:
    check_rel(what, predicted, measured, tol, " s")


@known_gap_xfail("gpt_184m_b16_offload_overlap.step_time", "step_time_s")
def test_step_time(overlap):
    """Step time within 10%. Measured 0.4545 s, predicted 0.389 s, error -14.4%."""
    _check("step", overlap["step_time_s"], MEASURED["median_step_s"], 0.10)


def test_gpu_fwd_bwd(overlap):
    """GPU forward + backward incl. gradient-copy sync within 15%. Measured 0.0485 s, predicted 0.0525 s, +8.3%."""
    _check("gpu_fwd_bwd", overlap["offload_gpu_fwd_bwd_s"], MEASURED["part_median_s"]["gpu_fwd_bwd"], 0.15)


@known_gap_xfail("gpt_184m_b16_offload_overlap.cpu_adam", "offload_cpu_optimizer_s")
def test_cpu_adam(overlap):
    """Grad cast + AdamW + param cast within 15%. Measured 0.4213 s, predicted 0.3298 s, error -21.7%."""
    _check("cpu_adam", overlap["offload_cpu_optimizer_s"],
           MEASURED["part_median_s"]["cpu_adam"], 0.15)


def test_h2d(overlap):
    """Parameter upload within 15%. Measured 7.37 ms, predicted 6.93 ms, error -5.9%."""
    _check("h2d", overlap["offload_h2d_s"], MEASURED["part_median_s"]["h2d"], 0.15)


def test_d2h_mostly_hidden(overlap):
    """Gradient copies overlap backward: what is left after backward is small (measured 19 us)."""
    assert overlap["offload_d2h_wait_s"] < 0.05 * overlap["offload_gpu_fwd_bwd_s"]


def _mean(v):
    return sum(v) / len(v)


def test_paper_step(paper):
    """ZeRO-Offload 10B step within 15%. Measured 25.77 s, predicted 22.22 s, error -13.8% (19.42 s, -24.6%, before
    the fresh checkpoint buffers' page faults, the Volta hosts' pageable rates and the scalar __half conversion)."""
    _check("step", paper["step_time_s"], PAPER["iteration_time_s"], 0.15)


@known_gap_xfail(ZO_ID, "phase_s.fwd_s")
def test_paper_forward(paper):
    """ZeRO-Offload 10B fwd within 15%. Measured 6.20 s, predicted 5.00 s, error -19.3% (4.98 s, -19.6%, before
    Megatron's vocab-parallel loss; 3.11 s, -49.8%, before the fresh checkpoint buffers' page faults)."""
    _check("forward", paper["phase_s"]["fwd_s"], _mean(PAPER["forward_time_s"]), 0.15)


def test_paper_backward(paper):
    """ZeRO-Offload 10B bwd within 15%. Measured 12.07 s, predicted 12.44 s, error +3.0% (11.83 s, -2.0%, before
    the checkpoints' H2D copies at the published 4.78 GB/s pageable rate; 8.81 s, -27.0%, before DeepSpeed 0.3's
    blocking fp32 gradient copies and per-bucket GPU passes were modelled)."""
    _check("backward", paper["phase_s"]["bwd_s"], _mean(PAPER["backward_time_s"]), 0.15)


@known_gap_xfail(ZO_ID, "phase_s.opt_s")
def test_paper_optimizer(paper):
    """ZeRO-Offload 10B optimizer within 15%. Measured 7.80 s, predicted 4.80 s, error -38.5% (of which
    optimizer_gradients 0.80 s predicted against 1.11-1.16 s logged)."""
    _check("optimizer", paper["phase_s"]["opt_s"], _mean(PAPER["optimizer_time_s"]), 0.15)


@known_gap_xfail(ZO_ID, "offload_cpu_optimizer_s")
def test_paper_cpu_adam(paper):
    """ZeRO-Offload 10B CPU Adam (optimizer_step) within 15%. Measured 6.35 s, predicted 3.99 s, -37.1% (3.68 s,
    -42.0%, before the scalar __half conversion was priced)."""
    _check("cpu_adam", paper["offload_cpu_optimizer_s"], sum(ZO_CPU_ADAM_S) / len(ZO_CPU_ADAM_S), 0.15)


def test_paper_cpu_adam_is_the_datasheet_roofline(paper):
    """The 10B CPU step is what the DGX-2 datasheet gives, by hand: 10,279,047,168 params in 604
    tensors, pinned state on one of two NUMA nodes: C = 6 channels x 2666 MT/s x 8 B x 0.8 = 102.4 GB/s;
    DeepSpeed 0.3 CPUAdam 28 B/param (its AVX-512 loop) + 6 B/param (its second loop: fp32 params
    read back, fp16 copies written into the pinned tile buffer) = 34 B/param (the gradients arrive in fp32,
    cast on the GPU by stage2.py: no CPU cast); the AVX-512 loop's compute (48 x 2.7 GHz x 2 FMA x 16 lanes =
    4.1e12 slots/s, 24 slots/param: its two divisions) does not bind, the second loop's scalar (__half) conversion
    does: 22.52 / 4 + 0.503 x 15 = 13.175 cycles per param on 48 cores at 2.7 GHz (hardware_models.host_kernels), above its
    6 B / C; one dispatch per tensor at the generic 10 us: T alone. 10 tiles of 2^30
    elements, the last of P - 9 x 2^30 = 615,370,752. Each of the first 9 tiles' fp16 copy-back (2^31 B at the
    Gen3 x16 rate r = 15.75 GB/s, w = 0.136 s) runs beside the next tile and takes r of the host DRAM (its
    max-min share C / 2 is above r): the tile, capped at its average rate c = 34 P / T, gets C - r for w, so
    it takes (c - C + r) w / c longer. Plus the last tile's copy-back after the last CPU op (+ 25 us latency)."""
    P = 10_279_047_168
    last = P - 9 * 2**30
    C, r = 6 * 2666e6 * 8 * 0.8, 15.75e9
    T = P * 28 / C + P * (22.52 / 4 + 0.503 * 15) / (48 * 2.7e9) + 604 * 10e-6
    c = P * 34 / T
    want = T + 9 * (c - C + r) * (2**31 / r) / c + 25e-6 + 2 * last / r
    assert paper["offload_cpu_optimizer_s"] == pytest.approx(want, rel=1e-9)


def test_validate_lists_the_paper_case():
    """`simulate validate` reports the 10B case's step, parts and CPU Adam."""
    rows = {(c.case_id, c.metric) for c in all_cases()}
    assert {(ZO_ID, m) for m in ("step_time_s", "phase_s.fwd_s", "phase_s.bwd_s", "phase_s.opt_s",
                                 "offload_cpu_optimizer_s")} <= rows


def test_paper_fits_on_32gb(paper):
    """The 10B model with ZeRO-Offload and full checkpointing ran on a 32 GB V100: it must fit."""
    assert paper["oom"] is None and paper["peak_memory_bytes"] <= paper["gpu_memory_capacity_bytes"]
