from pathlib import Path

import msgspec
import pytest

from draplane.api.codec import decode_object, encode_json
from draplane.simulation.trace import (
    COMPUTE,
    DRIVER,
    TraceError,
    TraceNode,
    TracePod,
    node_objects,
    pod_objects,
    read_nodes,
    read_pods,
    trace_node_of,
    trace_pod_of,
)

DATA = Path("/work/shared/data/alibaba-gpu-v2023")
if not DATA.exists():
    DATA = Path(__file__).resolve().parents[4] / "shared" / "data" / "alibaba-gpu-v2023"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def through_json(obj):
    """Encode and decode as the apiserver would see it, so the round trip covers the wire form."""
    return decode_object(msgspec.json.decode(encode_json(obj))) if obj is not None else None


def test_round_trip_of_a_trace_slice():
    nodes = read_nodes(DATA / "openb_node_list_all_node.csv")[:60]
    pods = read_pods(DATA / "openb_pod_list_multigpu20.csv")[:400]
    assert {n.model for n in nodes} and all(n.gpus > 0 for n in nodes)
    for node in nodes:
        k8s_node, slice_ = node_objects(node)
        assert trace_node_of(through_json(k8s_node), through_json(slice_)) == node
    kinds = set()
    for pod in pods:
        k8s_pod, claim = pod_objects(pod)
        assert trace_pod_of(through_json(k8s_pod), through_json(claim)) == pod
        kinds.add("cpu" if claim is None else "share" if pod.shares_gpu else f"{pod.num_gpu}x")
    assert {"cpu", "share", "1x", "8x"} <= kinds


def test_objects_are_what_the_issue_asks_for():
    node, slice_ = node_objects(TraceNode("n1", 96000, 393216, 8, "G2"))
    assert node.status.allocatable == {"cpu": "96000m", "memory": "393216Mi", "pods": "1001"}
    assert slice_.spec.driver == DRIVER and slice_.spec.node_name == "n1" and len(slice_.spec.devices) == 8
    gpu = slice_.spec.devices[0]
    assert gpu.allow_multiple_allocations is True
    assert gpu.attributes["model"].string_value == "G2"
    assert gpu.capacity["memory"].value == "20000Mi" and gpu.capacity["memory"].request_policy.default == "0"
    policy = gpu.capacity[COMPUTE].request_policy
    assert gpu.capacity[COMPUTE].value == "1000" and policy.default == "1000" and policy.valid_range.step == "1"

    _, share = pod_objects(TracePod("p", 4000, 1024, 1, 470, ("T4", "P100")))
    exact = share.spec.devices.requests[0].exactly
    assert exact.count == 1 and exact.capacity.requests == {COMPUTE: "470"}
    assert exact.selectors[0].cel.expression == 'device.attributes["gpu.nvidia.com"].model in ["T4", "P100"]'
    _, whole = pod_objects(TracePod("q", 4000, 1024, 4, 1000))
    assert whole.spec.devices.requests[0].exactly.count == 4
    assert whole.spec.devices.requests[0].exactly.capacity is None
    assert pod_objects(TracePod("r", 4000, 1024, 0, 0))[1] is None


def test_gpu_only_cluster_and_clamped_milli(tmp_path):
    nodes = write(tmp_path, "n.csv", "sn,cpu_milli,memory_mib,gpu,model\na,32000,1024,0,\nb,8000,1024,2,T4\n")
    assert [n.name for n in read_nodes(nodes)] == ["b"]
    assert [n.name for n in read_nodes(nodes, gpu_only=False)] == ["a", "b"]
    pods = write(tmp_path, "p.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,1000,10,1,1500\n")
    assert read_pods(pods)[0].gpu_milli == 1000


@pytest.mark.parametrize(
    "text, message",
    [
        ("name,cpu_milli,num_gpu,gpu_milli\np,1,1,1\n", r"p\.csv:1: missing column 'memory_mib'"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,-5,1,100\n", r"p\.csv:2: column 'memory_mib': -5 is negative"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,100\nq,x,1,1,100\n", r"p\.csv:3: column 'cpu_milli': 'x' is not an integer"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\np,1,1,1,100,T4|H100\n", r"p\.csv:2: column 'gpu_spec': unknown GPU model 'H100'"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,2,500\n", r"p\.csv:2: column 'gpu_milli': 500 with num_gpu 2"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1\n", r"p\.csv:2: 4 fields, the header has 5"),
        ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,100\np,1,1,1,100\n", r"p\.csv:3: column 'name': pod 'p' already on line 2"),
        ("", r"p\.csv:1: empty file"),
    ],
)
def test_bad_pod_files(tmp_path, text, message):
    with pytest.raises(TraceError, match=message):
        read_pods(write(tmp_path, "p.csv", text))


@pytest.mark.parametrize(
    "text, message",
    [
        ("sn,cpu_milli,memory_mib,gpu\nn,1,1,1\n", r"n\.csv:1: missing column 'model'"),
        ("sn,cpu_milli,memory_mib,gpu,model\nn,1,1,2,H100\n", r"n\.csv:2: column 'model': unknown GPU model 'H100'"),
        ("sn,cpu_milli,memory_mib,gpu,model\nn,-1,1,2,T4\n", r"n\.csv:2: column 'cpu_milli': -1 is negative"),
        ("sn,cpu_milli,memory_mib,gpu,model\nn,1,1,-2,T4\n", r"n\.csv:2: column 'gpu': -2 is negative"),
    ],
)
def test_bad_node_files(tmp_path, text, message):
    with pytest.raises(TraceError, match=message):
        read_nodes(write(tmp_path, "n.csv", text))
