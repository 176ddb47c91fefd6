"""Kubernetes' DRA CEL device-selector environment: the one place draplane compiles and evaluates CEL.

    program = compile_selector('device.attributes["gpu.nvidia.com"].type == "gpu"')
    program.matches(device_for_cel("gpu.nvidia.com", slice_device))

The engine (cel-expr-python, Google's C++ CEL runtime) stays behind this module; see README.md.
"""

from .device import CELDevice, device_for_cel, split_qualified_name
from .errors import CELCompileError, CELError, CELRuntimeError
from .references import projection, referenced_entries, slice_projection
from .selector import MAX_EXPRESSION_LENGTH, MAX_SELECTOR_COST, DeviceSelectorProgram, compile_selector
from .semver import Semver, SemverError, parse_semver

__all__ = [
    "CELCompileError",
    "CELDevice",
    "CELError",
    "CELRuntimeError",
    "DeviceSelectorProgram",
    "MAX_EXPRESSION_LENGTH",
    "MAX_SELECTOR_COST",
    "Semver",
    "SemverError",
    "compile_selector",
    "device_for_cel",
    "parse_semver",
    "projection",
    "referenced_entries",
    "slice_projection",
    "split_qualified_name",
]
