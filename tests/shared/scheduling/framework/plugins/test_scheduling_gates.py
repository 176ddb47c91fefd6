import msgspec

from draplane.api.core import Pod
from draplane.scheduling.framework.plugins import scheduling_gates


def test_a_gated_pod_is_not_queued_until_its_last_gate_goes():
    gated = msgspec.convert({"metadata": {"name": "p"}, "spec": {
        "containers": [{"name": "c"}], "schedulingGates": [{"name": "kueue.x-k8s.io/admission"}, {"name": "quota"}]}}, Pod)
    assert scheduling_gates.gates(gated) == ["kueue.x-k8s.io/admission", "quota"]
    assert scheduling_gates.pre_enqueue(gated) == "waiting for scheduling gates: [kueue.x-k8s.io/admission quota]"
    free = msgspec.structs.replace(gated, spec=msgspec.structs.replace(gated.spec, scheduling_gates=[]))
    assert scheduling_gates.pre_enqueue(free) is None
