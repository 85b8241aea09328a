"""Bytes per element of the dtypes a scenario can name (the one table every layer reads)."""

from __future__ import annotations

#: Bytes per element, as ``torch.finfo(dtype).bits // 8``: bf16/fp16 2, fp32 4, fp8 (e4m3/e5m2) 1. ``tf32`` is
#: fp32 storage multiplied on TF32 tensor cores (NVIDIA A100 whitepaper, "TF32"), so 4 B per operand.
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4, "fp8": 1}
