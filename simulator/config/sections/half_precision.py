"""DeepSpeed's ``fp16`` / ``bf16`` sections: the low-precision master weights, gradients and optimizer states.

YAML (DeepSpeed's names; the model's dtype itself is ``training.precision``)::

    fp16:
      fp16_master_weights_and_grads: true   # ZeRO-Offload: fp16 master parameters and gradients, fp32 moments
    bf16:
      bf16_master_weights_and_grads: true   # ZeRO-Offload: bf16 master parameters and gradients
      bf16_optimizer_states: true           # and bf16 Adam moments (needs the line above)

What DeepSpeed does with them (deepspeedai/DeepSpeed@02736449 ``deepspeed/runtime/base_optimizer.py``
``_configure_master_weights``, the ZeRO optimizers' common check; @02aa38c3 ``deepspeed/runtime/zero/stage_1_and_2.py``):
the ZeRO optimizer's master partition (``single_partition_of_fp32_groups``) and its gradient buffer are created in
the master dtype (16-bit instead of fp32), the gradients are copied to the host without the ``.float()`` cast
(``async_inplace_copy_grad_to_fp32_buffer_from_gpu``), and the step's ``bit16_partitions[...].copy_(fp32_partition)``
copies the 16-bit master up as it is. The moments stay fp32 unless ``bf16_optimizer_states``; DeepSpeedCPUAdam has a
kernel for each (parameter, moment) pair used: (fp16, fp32), (bf16, fp32), (bf16, bf16)
(@1640828d ``csrc/adam/cpu_adam_impl.cpp`` ``InvokerInitializer``). Priced by ``simulator/policies/offload_optimizer.py``
(``master_dtypes``).

DeepSpeed's rules, refused here in one line each (``check_master_weights``):

* the two master options are exclusive, and ``bf16_optimizer_states`` needs ``bf16_master_weights_and_grads``
  (``_configure_master_weights``; @3a890ec5 ``deepspeed/runtime/config.py`` ``_do_error_check``);
* a ZeRO stage 1, 2 or 3 (``_do_error_check``: "only supported with ZeRO Stage 1, 2, or 3");
* fp16 master weights, and bf16 master weights with fp32 moments, need ZeRO-Offload with DeepSpeedCPUAdam
  (stage_1_and_2.py ``_enforce_cpu_offload``, stage3.py ``_enforce_optimizer_offload``: "Master weights feature
  requires ZeRO-N Offload with DeepSpeedCPUAdam"); here ``offload_optimizer.device: cpu`` and ``cpu_adam_impl:
  deepspeed_cpu_adam`` (``deepspeed_cpu_adam_2020``, DeepSpeed 0.3's kernel, takes fp32 only);
* offloaded bf16 moments need DeepSpeedCPUAdam built with ``fp32_optimizer_states=False`` (its ``optimizer.params``;
  DeepSpeed asserts otherwise): what is modelled when ``bf16_optimizer_states`` is set with offload.

Not modelled, refused as such: all-bf16 states kept on the GPU (no offload: DeepSpeed allows it with
``bf16_optimizer_states``), and NVMe offload with them (the swapper's buffers in the master dtype).
"""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from simulator.config.limits import MODEL_CONFIG


class _Model(BaseModel):
    model_config = MODEL_CONFIG


class Fp16SectionConfig(_Model):
    """DeepSpeed ``fp16`` (the key modelled beside ``training.precision: fp16``)."""

    enabled: bool | None = Field(default=None, description="DeepSpeed's fp16.enabled: accepted when it agrees with "
                                 "training.precision (fp16 is set there).")
    fp16_master_weights_and_grads: bool = Field(
        default=False, description="ZeRO-Offload with DeepSpeedCPUAdam: fp16 master parameters and gradients on the "
        "host (2 B each instead of 4), fp32 moments; needs training.precision fp16.")


class Bf16SectionConfig(_Model):
    """DeepSpeed ``bf16`` (the keys modelled beside ``training.precision: bf16``)."""

    enabled: bool | None = Field(default=None, description="DeepSpeed's bf16.enabled: accepted when it agrees with "
                                 "training.precision (bf16 is set there).")
    bf16_master_weights_and_grads: bool = Field(
        default=False, description="ZeRO-Offload with DeepSpeedCPUAdam: bf16 master parameters and gradients on the "
        "host (2 B each instead of 4); needs training.precision bf16.")
    bf16_optimizer_states: bool = Field(
        default=False, description="And bf16 Adam moments (2 B each instead of 4; DeepSpeedCPUAdam built with "
        "fp32_optimizer_states=False); needs bf16_master_weights_and_grads.")

    @model_validator(mode="after")
    def _states_need_master(self):
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ValueError("bf16_optimizer_states requires bf16_master_weights_and_grads to be enabled (DeepSpeed's "
                             "rule, deepspeed/runtime/config.py _do_error_check)")
        return self


def master_dtypes(cfg) -> tuple[str, str]:
    """``(master, moments)`` dtypes of the ZeRO optimizer's host state: ``("fp32", "fp32")`` unless a section
    above sets them (``("fp16", "fp32")``, ``("bf16", "fp32")``, ``("bf16", "bf16")``)."""
    f, b = getattr(cfg, "fp16", None), getattr(cfg, "bf16", None)
    if f is not None and f.fp16_master_weights_and_grads:
        return "fp16", "fp32"
    if b is not None and b.bf16_master_weights_and_grads:
        return "bf16", "bf16" if b.bf16_optimizer_states else "fp32"
    return "fp32", "fp32"


def check_master_weights(cfg) -> str | None:
    """The first of DeepSpeed's rules (module docstring) the scenario breaks, or a combination not modelled, as one
    line naming the key; None when it is fine."""
    f, b = cfg.fp16, cfg.bf16
    prec = cfg.training.precision
    for name, sec in (("fp16", f), ("bf16", b)):
        if sec is None:
            continue
        keys = [k for k in type(sec).model_fields if k != "enabled" and getattr(sec, k)]
        if sec.enabled and prec != name:
            return f"{name}.enabled: true is training.precision: {name} here, got {prec}"
        if sec.enabled is False and prec == name:  # DeepSpeed would not run the model in it
            return f"{name}.enabled: false contradicts training.precision: {name} (allowed: true, or leave it out)"
        if sec.enabled is False and keys:
            return f"{name}.{keys[0]}: DeepSpeed's {name} section is disabled ({name}.enabled false); remove one"
        if keys and prec != name:
            return (f"{name}.{keys[0]}: needs training.precision {name} (the master weights take the model's "
                    f"16-bit dtype), got {prec}")
    master, states = master_dtypes(cfg)
    if master == "fp32":
        return None
    key = "fp16.fp16_master_weights_and_grads" if master == "fp16" else "bf16.bf16_master_weights_and_grads"
    z = cfg.zero_optimization
    if z.stage == 0:
        return (f"{key}: is only supported with ZeRO Stage 1, 2, or 3 (DeepSpeed's rule); got zero_optimization.stage 0")
    dev = z.offload_optimizer.device
    if dev == "none":
        if states == "bf16":
            return (f"bf16.bf16_optimizer_states: bf16 master weights and moments kept on the GPU (no offload) are not "
                    "modelled (allowed: zero_optimization.offload_optimizer.device cpu)")
        return (f"{key}: Master weights feature requires ZeRO-{z.stage} Offload with DeepSpeedCPUAdam (DeepSpeed's "
                "rule; allowed: zero_optimization.offload_optimizer.device cpu, cpu_adam_impl deepspeed_cpu_adam)")
    if dev == "nvme":
        return f"{key}: not modelled with offload_optimizer.device nvme (allowed: device cpu)"
    impl = z.offload_optimizer.cpu_adam_impl
    if impl != "deepspeed_cpu_adam":
        why = " (DeepSpeed 0.3's kernel takes fp32 only)" if impl == "deepspeed_cpu_adam_2020" else ""
        return (f"{key}: Master weights feature requires ZeRO-{z.stage} Offload with DeepSpeedCPUAdam (DeepSpeed's "
                f"rule), got zero_optimization.offload_optimizer.cpu_adam_impl {impl}{why}; allowed: deepspeed_cpu_adam")
    return None
