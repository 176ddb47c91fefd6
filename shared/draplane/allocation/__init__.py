"""The allocator core: pure resource.k8s.io/v1 allocation, no I/O and no asyncio.

- `Inventory` (ResourceSlices → pools of device records), `AllocatedState` (what is in use),
- `NodeAllocator.allocate` (claims on one node, all-or-nothing, Kubernetes semantics),
- `DeviceAllocator.allocate` (the best node per the scoring policy, cached per claim shape),
- `scoring` (the pluggable policies: `first-fit`, `draplane`).
"""

from draplane.allocation.allocator import NodeAllocator, NodePlacement, SelectorMatcher
from draplane.allocation.device_allocator import DeviceAllocator, Unallocatable
from draplane.allocation.errors import AllocationError, NodeFailure, Reason
from draplane.allocation.inventory import Inventory
from draplane.allocation.scoring import ScoringPolicy, get_policy, policy_names, register_policy
from draplane.allocation.state import AllocatedState, claim_key

__all__ = [
    "AllocatedState", "AllocationError", "DeviceAllocator", "Inventory", "NodeAllocator", "NodeFailure", "NodePlacement",
    "Reason", "ScoringPolicy", "SelectorMatcher", "Unallocatable", "claim_key", "get_policy", "policy_names",
    "register_policy",
]

# Registers the fragmentation-aware `draplane` policy over the topology-only one, so the service,
# the CLI and the simulator all get the same default (see fragmentation.FragmentationAwareDraplane).
from draplane.allocation import fragmentation as _fragmentation  # noqa: E402,F401
