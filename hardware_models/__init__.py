"""Hardware models: specs (frozen dataclasses), presets (YAML data files) and runtime mechanisms.

This package knows about FLOP/s, bytes, seconds, watts and MHz; it never imports ``simulator``.
"""

from hardware_models.gpu import GpuSpec
from hardware_models.host import HostCpuSpec, HostMemorySpec
from hardware_models.fabrics import LinkSpec
from hardware_models.profile import EfficiencyProfile

__all__ = ["GpuSpec", "HostCpuSpec", "HostMemorySpec", "LinkSpec", "EfficiencyProfile"]
