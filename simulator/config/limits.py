"""Upper bounds on scenario sizes, and the strict pydantic settings every schema section shares.

A size past these bounds cannot describe a real training run, and past some of them the simulator
would hang or exhaust memory building the step (its work grows with layers x micro-batches x
steps). Each bound is far above any published model, so a real scenario never meets one; the
error names the key and the bound. For scale (public model cards and papers): GPT-3 175B has 96
layers, hidden 12,288, vocab 50,257 (Brown et al., 2020); PaLM 540B has 118 layers and hidden
18,432 (Chowdhery et al., 2022); Megatron-LM's 1T configuration has 128 layers and hidden 25,600
(Narayanan et al., SC'21); Gemma's vocabulary has 256,000 entries; Gemini 1.5 reports contexts of
up to 10M tokens.
"""

from __future__ import annotations

from pydantic import ConfigDict

#: Settings of every scenario model: unknown keys are errors; no NaN or infinity; no coercion
#: (``true`` is not 1, ``"8"`` is not 8, ``8.5`` is not an integer).
MODEL_CONFIG = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

MAX_NUM_LAYERS = 10_000
MAX_HIDDEN_SIZE = 1_000_000
MAX_FFN_HIDDEN_SIZE = 4_000_000
#: routed experts per MoE block (DeepSeek-V3 has 256; a bound on the schema, not on the model)
MAX_NUM_EXPERTS = 65_536
#: MoE expert capacity factor (Megatron --moe-expert-capacity-factor; Switch Transformers use 1.0-2.0)
MAX_CAPACITY_FACTOR = 1_000.0
MAX_SEQ_LENGTH = 10_000_000
MAX_VOCAB_SIZE = 10_000_000
#: ViT image side, pixels (a 100k x 100k image with patch 16 is 39M tokens, past MAX_SEQ_LENGTH already)
MAX_IMAGE_SIZE = 100_000
#: ViT image channels (RGB 3; multispectral satellite images have tens)
MAX_NUM_CHANNELS = 10_000
MAX_MICRO_BATCH_SIZE = 1_000_000
MAX_GLOBAL_BATCH_SIZE = 100_000_000
#: Micro-batches per step (global_batch_size / (micro_batch_size x data_parallel_size)).
MAX_GRADIENT_ACCUMULATION = 10_000
#: num_layers x micro-batches per step x run.steps: the simulator's work (about a millisecond of
#: CPU per layer pass on the development machine, so a run is bounded by a few minutes).
MAX_LAYER_PASSES = 100_000
MAX_DATA_PARALLEL_SIZE = 1_000_000
MAX_STEPS = 100_000
#: The run's seed is a 64-bit unsigned integer (``numpy.random.default_rng`` takes any >= 0).
MAX_SEED = 2**64 - 1
#: Per-op host launch time, s (measured CUDA launch overheads are 2-20 us).
MAX_LAUNCH_OVERHEAD_S = 1.0
#: DataLoader: worker processes and batches in flight per worker.
MAX_NUM_WORKERS = 4096
MAX_PREFETCH_FACTOR = 1024
#: Seconds of CPU per sample or per batch, and bytes per sample.
MAX_SAMPLE_COST_S = 3600.0
MAX_SAMPLE_BYTES = 1e12
#: Cores of remote preprocessing hosts.
MAX_REMOTE_CORES = 1_000_000
#: ZeRO gradient bucket, elements.
MAX_REDUCE_BUCKET_SIZE = 10**13
#: DVFS: clocks (MHz), power limits (W) and controller times (s).
MAX_CLOCK_MHZ = 100_000.0
MAX_POWER_W = 100_000.0
MAX_DVFS_TIME_S = 100.0
#: Shortest power-controller period, s (NVIDIA boards re-evaluate every few ms; 0.1 ms bounds the
#: controller's ticks per simulated second).
MIN_POWER_SAMPLE_PERIOD_S = 1e-4


def integral_count(cls, v):
    """``mode="before"`` field validator for element counts written as DeepSpeed configurations write them
    (``"reduce_bucket_size": 5e8``, ``"stage3_max_live_parameters": 1e9``): an integral float is taken as its
    integer, as DeepSpeed's own config model does (pydantic's lax int; microsoft/DeepSpeed
    deepspeed/runtime/zero/config.py declares these fields ``int``); a boolean is an error; anything else is left
    to the field's type (``5.5e7`` is refused there as not an integer).

    Raises:
        ValueError: ``v`` is ``True`` or ``False``.
    """
    v = no_bool(cls, v)
    return int(v) if isinstance(v, float) and v.is_integer() else v


def no_bool(cls, v):
    """``mode="before"`` field validator: a boolean where a number is expected is an error
    (``Literal[0, 1]`` fields would otherwise take ``true`` as 1).

    Raises:
        ValueError: ``v`` is ``True`` or ``False``.
    """
    if isinstance(v, bool):
        raise ValueError("expected a number")  # the loader's message adds "(got true)"
    return v
