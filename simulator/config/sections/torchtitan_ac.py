"""Scenario key ``activation_checkpoint``: torchtitan's ``[activation_checkpoint]`` section, under its own names.

::

    activation_checkpoint:
      mode: selective            # none | selective | full | memory_budget (refused); torchtitan's default: selective
      selective_ac_option: op    # "op", or an int n: every n-th block checkpointed (torchtitan's default: "2")
      early_stop: false          # torch's early stop of the recompute (torchtitan's default: false)

torchtitan wraps each ``TransformerBlock`` (pytorch/torchtitan@81c12433 torchtitan/models/llama3/infra/parallelize.py
``apply_ac``, ``_apply_ac_to_transformer_block``; since moved to torchtitan/distributed/activation_checkpoint.py
``_apply_op_sac`` / ``_apply_layer_sac`` / ``_apply_full_ac``, pytorch/torchtitan@cfb93265, called from
llama3/infra/parallelize.py with its ``_op_sac_save_list``, pytorch/torchtitan@018740b7):

* ``full``: every block through ``checkpoint_wrapper`` (its input kept, its forward re-run before its backward):
  the builder's ``recompute: full``, the same graph as ``training.recompute_granularity: full``;
* ``selective`` with an int ``n``: a counter over the wrapped blocks (``ptd_checkpoint_wrapper._count``, from 1)
  checkpoints block ``i`` (0-based) whole when ``(i + 1) % n == 0``, or every block when ``n`` is 0
  (``not ac_freq``); the others keep all their activations. The counter runs over every block the process
  wraps, across pipeline chunks: refused with pipeline parallelism (not modelled);
* ``selective`` with ``op``: per-op selective checkpointing (``simulator/graph/builders/op_sac.py``).

``mode`` and ``selective_ac_option`` default to torchtitan's "selective" and "2" (pytorch/torchtitan@0011fb90
torchtitan/config_manager.py, the same at pytorch/torchtitan@6404b932 torchtitan/config/job_config.py).
**The other keys** take torchtitan's defaults (``ActivationCheckpoint`` of torchtitan/config/job_config.py in the
revision that has them, read without its commit: pytorch/torchtitan@6404b932 still has only ``mode``,
``selective_ac_option`` and ``per_op_sac_force_recompute_mm_shapes_by_fqns``), every wrapper getting them
(``ptd_checkpoint_wrapper(..., preserve_rng_state=, determinism_check=, early_stop=, debug=)``,
pytorch/torchtitan@cfb93265 torchtitan/distributed/activation_checkpoint.py). A key at its default is accepted as
it stands; another value is priced, refused in one line naming it (``check_scenario``), or, where it changes no
time or memory of the step, accepted with a warning (``without_effect``):

* ``early_stop`` (false): torch's non-reentrant checkpoint stops its recompute once every tensor the backward
  unpacks exists again (torch/utils/checkpoint.py: ``set_checkpoint_early_stop``, "by default, non-reentrant
  checkpoint stops recomputation as soon as it has computed all needed Tensors", the ``_CheckpointFrame``'s
  early-stop flag, ``_recomputation_hook`` raising ``_StopRecomputationError``); false, torchtitan's default, runs
  the block's whole forward again. Priced both ways for ``op`` (``op_sac.recompute``); ``full`` and ``n`` are priced
  without it (the whole block re-run), true refused there. torchtitan before the key passed no ``early_stop``
  (pytorch/torchtitan@81c12433 ``ptd_checkpoint_wrapper(module, preserve_rng_state=False)``), so ran with torch's
  default, early stop on: ``early_stop: true`` stands for such a run;
* ``per_op_sac_force_recompute_mm_shapes_by_fqns`` (["moe.router.gate"]): the mm shapes of the named ``nn.Linear``
  forced recomputed in op mode (``_apply_op_sac``: any module whose fqn contains an entry); the default, and [],
  name no module of the dense Llama block, other values with op are refused;
* ``memory_budget`` (0.5), ``visualize_memory_budget_pareto`` (false): read with mode memory_budget only (refused);
* ``preserve_rng_state`` (false): true stashes and restores the RNG state around each recompute: refused (not
  priced);
* ``determinism_check`` ("default"; torch also takes "none"), ``debug`` (false): host-side checks / logs of the
  recompute, not priced: warned.

The section stands for torchtitan's model (``fsdp.version 2``: separate ``wq`` / ``wk`` / ``wv``, SwiGLU ``w1`` /
``w3`` / ``w2``), so it needs ``fsdp.version 2``, and it replaces ``training.recompute_granularity`` (one of them).
Without the section an ``fsdp.version 2`` run prices ``training.recompute_granularity`` (none when unset), not
torchtitan's default (selective, every 2nd block), and says so (``api.fsdp2_ac_note``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from simulator.config.limits import MAX_NUM_LAYERS, MODEL_CONFIG

#: torchtitan's ``[activation_checkpoint] mode`` values (``memory_budget``: refused, needs torch.compile)
MODES = ("none", "selective", "full", "memory_budget")
#: the modes modelled here
MODELLED_MODES = ("none", "selective", "full")
#: torchtitan's defaults of the keys beside ``mode`` / ``selective_ac_option`` (module docstring)
FORCE_RECOMPUTE_DEFAULT = ("moe.router.gate",)
#: torch.utils.checkpoint's ``determinism_check`` values (``_DEFAULT_DETERMINISM_MODE`` "default", and "none")
DETERMINISM_CHECKS = ("default", "none")


class TorchtitanActivationCheckpoint(BaseModel):
    """torchtitan's ``[activation_checkpoint]``: every key of its ``ActivationCheckpoint`` (module docstring)."""

    model_config = MODEL_CONFIG

    mode: Literal[MODES] = Field(  # type: ignore[valid-type]
        default="selective", description="torchtitan [activation_checkpoint] mode: none, full (every TransformerBlock "
        "checkpointed whole), selective (selective_ac_option); memory_budget (torch.compile's partitioner) is refused. "
        "Default selective, torchtitan's.")
    selective_ac_option: Literal["op"] | int = Field(
        default=2, description="torchtitan [activation_checkpoint] selective_ac_option with mode selective: op "
        "(per-op: the outputs of every other aten.mm, of SDPA, of the TP reduce-scatters and of aten.max saved, the "
        "rest recomputed in backward; simulator/graph/builders/op_sac.py) or an int n >= 0 (every n-th block "
        "checkpointed whole, 0: every block). A string of digits (TOML) is read as the int. Default 2, torchtitan's.")
    early_stop: bool = Field(
        default=False, description="torch's early stop of the recompute (it ends once every tensor the backward "
        "needs exists again): priced with selective_ac_option op; false (torchtitan's default) re-runs the block's "
        "whole forward. true with mode full or an int option is refused (priced as the whole block re-run).")
    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = Field(
        default=list(FORCE_RECOMPUTE_DEFAULT), description="torchtitan's force-recompute list for op mode; its "
        "default ['moe.router.gate'] (and []) names no module of the dense Llama block; other values with op are "
        "refused, and have no effect otherwise.")
    memory_budget: float = Field(
        default=0.5, description="torchtitan's budget for mode memory_budget (refused): no effect with another mode.")
    visualize_memory_budget_pareto: bool = Field(
        default=False, description="torchtitan's SVG dump of mode memory_budget: no effect on the step.")
    preserve_rng_state: bool = Field(
        default=False, description="torchtitan's default false; true (the RNG state stashed and restored around each "
        "recompute) is refused where a block is checkpointed (not priced).")
    determinism_check: Literal[DETERMINISM_CHECKS] = Field(  # type: ignore[valid-type]
        default="default", description="torch.utils.checkpoint determinism_check (default or none): a host-side "
        "check of the recomputed tensors' metadata, not priced.")
    debug: bool = Field(
        default=False, description="torch.utils.checkpoint debug (operator logs of forward and recompute): host "
        "side, not priced.")

    @field_validator("mode", mode="before")
    @classmethod
    def _mode(cls, v):
        """One of ``MODES``; the message lists torchtitan's modes and the ones modelled."""
        if v in MODES:
            return v
        raise ValueError(f"{v!r} is not a torchtitan activation_checkpoint mode (torchtitan's: {', '.join(MODES)}; "
                         f"modelled here: {', '.join(MODELLED_MODES)})")

    @field_validator("selective_ac_option", mode="before")
    @classmethod
    def _option(cls, v):
        """``"op"``, an int ``0..MAX_NUM_LAYERS``, or its digits as a string (torchtitan's TOML writes ``"2"``)."""
        if isinstance(v, str) and v.isdigit():
            v = int(v)
        if v == "op" or (type(v) is int and 0 <= v <= MAX_NUM_LAYERS):
            return v
        raise ValueError(f"{v!r} is not a torchtitan selective_ac_option (allowed: 'op', or an int n with "
                         f"0 <= n <= {MAX_NUM_LAYERS}: every n-th block checkpointed)")

    @property
    def recompute(self) -> tuple[str, int]:
        """``(TransformerSpec.recompute, recompute_every)``: ``("none", 1)``, ``("full", 1)``, ``("op", 1)`` or
        ``("full", n)`` for every ``n``-th block (``n`` 0 or 1: every block, ``("full", 1)``)."""
        if self.mode == "none":
            return "none", 1
        if self.mode == "full":
            return "full", 1
        if self.selective_ac_option == "op":
            return "op", 1
        n = self.selective_ac_option
        return "full", 1 if n in (0, 1) else n

    def checkpoints_a_block(self, num_layers: int) -> bool:
        """Whether any of ``num_layers`` blocks is checkpointed (not with mode none, nor an option ``n`` above the
        block count: block ``i`` when ``(i + 1) % n == 0``)."""
        mode, every = self.recompute
        return mode != "none" and every <= num_layers

def recompute_of(cfg) -> tuple[str, int]:
    """The recompute a scenario (``ScenarioConfig``) builds: ``(TransformerSpec.recompute, recompute_every)`` from
    ``activation_checkpoint`` when given, else from ``training.recompute_granularity`` (``("none", 1)`` unset)."""
    ac = cfg.activation_checkpoint
    if ac is not None:
        return ac.recompute
    return cfg.training.recompute_granularity or "none", 1


def early_stop_of(cfg) -> bool:
    """``TransformerSpec.recompute_early_stop`` of a scenario: ``activation_checkpoint.early_stop`` with the op
    option (the one recompute it is priced for), else False."""
    ac = cfg.activation_checkpoint
    return ac is not None and ac.early_stop and ac.recompute[0] == "op"


def check_scenario(cfg) -> None:
    """The scenario-level checks of ``activation_checkpoint`` (a ``ScenarioConfig``).

    Raises:
        ValueError: naming the key and what is allowed: no fsdp.version 2, beside training.recompute_granularity or
            DeepSpeed's activation_checkpointing.cpu_checkpointing, mode memory_budget, an int option under pipeline
            parallelism, early_stop true with a whole-block checkpoint, preserve_rng_state true where a block is
            checkpointed, or the op option outside what ``op_sac`` models.
    """
    ac = cfg.activation_checkpoint
    if ac is None:
        return
    if ac.mode == "memory_budget":
        raise ValueError(f"activation_checkpoint.mode: memory_budget (torch.compile's partitioner under an activation "
                         f"memory budget) is torchtitan's but not modelled (torchtitan's modes: {', '.join(MODES)}; "
                         f"allowed here: {', '.join(MODELLED_MODES)})")
    if cfg.fsdp is None or cfg.fsdp.version != 2:
        raise ValueError("activation_checkpoint is torchtitan's [activation_checkpoint] for its FSDP2 Llama: it needs "
                         "fsdp: {version: 2} (allowed: add it, or training.recompute_granularity for Megatron-LM)")
    if cfg.training.recompute_granularity is not None:
        raise ValueError("activation_checkpoint and training.recompute_granularity both set the recompute (allowed: "
                         "one of them; activation_checkpoint.mode full is recompute_granularity full)")
    if cfg.activation_checkpointing.cpu_checkpointing:
        raise ValueError("activation_checkpointing.cpu_checkpointing (DeepSpeed) with torchtitan's "
                         "activation_checkpoint is not modelled (allowed: cpu_checkpointing false)")
    mode, every = ac.recompute
    p = cfg.parallelism
    if every > 1 and p.pipeline_model_parallel_size > 1:
        raise ValueError(f"activation_checkpoint.selective_ac_option: {every} with pipeline_model_parallel_size > 1 is "
                         "not modelled (torchtitan's block counter runs across the process's pipeline chunks; "
                         "allowed: op, 0 or 1, or pipeline_model_parallel_size 1)")
    if not ac.checkpoints_a_block(cfg.model.num_layers):
        return  # nothing checkpointed: the other keys change nothing (without_effect)
    if ac.early_stop and mode == "full":
        what = "mode full" if ac.mode == "full" else f"selective_ac_option {ac.selective_ac_option}"
        raise ValueError(f"activation_checkpoint.early_stop: true with {what} is not modelled (a checkpointed block's "
                         "forward is priced re-run whole, torch's early stop off; allowed: early_stop false, "
                         "torchtitan's default, or selective_ac_option op, priced both ways)")
    if ac.preserve_rng_state:
        raise ValueError("activation_checkpoint.preserve_rng_state: true is not modelled (the RNG state stashed before "
                         "and restored around each block's recompute is not priced; allowed: false, torchtitan's "
                         "default)")
    if mode == "op":
        _check_op(cfg)


def without_effect(cfg) -> list[str]:
    """One line per ``activation_checkpoint`` key given where it changes no time or memory of the step (the run's
    ``ineffective_setting_warnings``; what does and is not modelled is refused by ``check_scenario``).

    ``selective_ac_option`` beside ``mode`` none or full, which torchtitan does not read it with
    (pytorch/torchtitan@81c12433 torchtitan/models/llama3/infra/parallelize.py: ``apply_ac`` only for a mode other
    than none, ``_apply_ac_to_transformer_block`` wraps every block for full before reading the option), or an int
    ``n`` above the model's block count, which checkpoints no block (``recompute``: block ``i`` when ``(i + 1) % n ==
    0``; pipelines refuse ``n`` > 1, so the blocks are the model's); the wrapper's keys (``early_stop``,
    ``preserve_rng_state``, ``determinism_check``, ``debug``) where no block is checkpointed; the force-recompute
    list outside op mode, or [] in it (the default names no module of the dense block either); the memory-budget
    keys (read with mode memory_budget only, refused); ``determinism_check`` none and ``debug`` true (host-side,
    not priced)."""
    ac = cfg.activation_checkpoint
    if ac is None:
        return []
    given = ac.model_fields_set
    out = []
    opt, L = ac.selective_ac_option, cfg.model.num_layers
    if "selective_ac_option" in given and ac.mode in ("none", "full"):
        out.append(f"activation_checkpoint.selective_ac_option {opt} has no effect with mode {ac.mode} (read only with "
                   "mode selective); the run is the same without it")
    elif "selective_ac_option" in given and isinstance(opt, int) and opt > L:
        out.append(f"activation_checkpoint.selective_ac_option {opt} checkpoints none of the model's {L} blocks (block "
                   f"i when (i + 1) % {opt} == 0): the run is the same as mode none")
    wrapped = ac.checkpoints_a_block(L)
    changed = [k for k, default in (("early_stop", False), ("preserve_rng_state", False),
                                    ("determinism_check", "default"), ("debug", False)) if getattr(ac, k) != default]
    if changed and not wrapped:
        out.append(f"activation_checkpoint.{', '.join(changed)} ha{'s' if len(changed) == 1 else 've'} no effect: no "
                   "block is checkpointed; the run is the same without "
                   f"{'it' if len(changed) == 1 else 'them'}")
    elif wrapped:
        if ac.determinism_check != "default":
            out.append("activation_checkpoint.determinism_check none: torch's check of the recomputed tensors' "
                       "metadata is host-side and not priced; the run is the same without it")
        if ac.debug:
            out.append("activation_checkpoint.debug true: torch's operator logs of forward and recompute are "
                       "host-side and not priced; the run is the same without it")
    fqns = ac.per_op_sac_force_recompute_mm_shapes_by_fqns
    if tuple(fqns) != FORCE_RECOMPUTE_DEFAULT and (ac.recompute[0] != "op" or not fqns):
        why = "read only with selective_ac_option op" if ac.recompute[0] != "op" else (
            "like its default ['moe.router.gate'], it names no Linear of the dense Llama block")
        out.append(f"activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns {fqns} has no effect ({why}); "
                   "the run is the same without it")
    budget = [k for k, default in (("memory_budget", 0.5), ("visualize_memory_budget_pareto", False))
              if getattr(ac, k) != default]
    if budget:
        out.append(f"activation_checkpoint.{', '.join(budget)} ha{'s' if len(budget) == 1 else 've'} no effect with "
                   f"mode {ac.mode} (read only with mode memory_budget); the run is the same without "
                   f"{'it' if len(budget) == 1 else 'them'}")
    return out


def _check_op(cfg) -> None:
    """What ``selective_ac_option: op`` is modelled for (``op_sac.py``): torchtitan's dense Llama block."""
    m, p, t = cfg.model, cfg.parallelism, cfg.training
    refused = [(k, v) for k, v, on in (
        ("model.swiglu", False, not m.swiglu),
        ("model.position_embedding_type", m.position_embedding_type, m.position_embedding_type != "rope"),
        ("model.attention_backend", m.attention_kernel, m.attention_kernel != "flash"),
        ("model.add_bias_linear", True, m.add_bias_linear),  # Linear with bias is aten.addmm, not aten.mm
        ("model.add_qkv_bias", True, m.add_qkv_bias),
        ("model.num_experts", m.num_experts, m.num_experts is not None),
        ("model.kernels", m.kernels, m.kernels != "fused"),
        ("model.attention_dropout", m.attention_dropout, m.attention_dropout > 0),
        ("model.hidden_dropout", m.hidden_dropout, m.hidden_dropout > 0),
        ("parallelism.context_parallel_size", p.context_parallel_size, p.context_parallel_size > 1),
        ("parallelism.sequence_parallel", False, p.tensor_model_parallel_size > 1 and not p.sequence_parallel),
        ("parallelism.tp_comm_overlap", p.tp_comm_overlap, p.tp_comm_overlap is not False),
        ("fsdp.mixed_precision", cfg.fsdp.mixed_precision_label, cfg.fsdp.dtypes[0] != "bf16"),
        ("training.lora", "set", t.lora is not None),
        ("activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
         cfg.activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns,
         tuple(cfg.activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns) not in (
             FORCE_RECOMPUTE_DEFAULT, ()))) if on]
    if refused:
        k, v = refused[0]
        raise ValueError(f"activation_checkpoint.selective_ac_option: op with {k} {v} is not modelled (allowed: "
                         "torchtitan's dense Llama block: SwiGLU, rope, flash attention, no biases or dropout, "
                         "fsdp.mixed_precision param_dtype bf16 (the dtype FSDP2 gathers the weights the mm run in), "
                         "tensor parallelism with sequence_parallel, no context parallelism, LoRA or tp_comm_overlap, "
                         "per_op_sac_force_recompute_mm_shapes_by_fqns its default ['moe.router.gate'] or [])")

