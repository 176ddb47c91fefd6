"""Documents that are not DRA objects at all, and the DRA parts of Pods."""

from draplane.validation import validate_object
from draplane.validation.problem import NOT_AN_OBJECT, UNSUPPORTED


def test_not_a_mapping():
    problems = validate_object(["a", "b"])
    assert [(p.kind, p.reason) for p in problems] == [("<document>", NOT_AN_OBJECT)]
    assert "a list of 2 items" in problems[0].message
    assert validate_object("just text")[0].reason == NOT_AN_OBJECT


def test_mapping_without_kind_or_api_version():
    problems = validate_object({"name": "x", "spec": {}})
    assert [(p.field, p.reason) for p in problems] == [("apiVersion and kind", NOT_AN_OBJECT)]
    assert "apiVersion: resource.k8s.io/v1" in problems[0].fix


def test_unknown_kind():
    problems = validate_object({"apiVersion": "resource.k8s.io/v1", "kind": "Deployment", "metadata": {"name": "web"}})
    assert [(p.kind, p.name, p.field, p.reason) for p in problems] == [("Deployment", "web", "kind", UNSUPPORTED)]


def test_kinds_of_other_api_groups_are_not_judged():
    assert validate_object({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"}}) == []
    assert validate_object({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}}) == []


def test_old_api_version_says_what_changed(build):
    claim = build.claim()
    claim["apiVersion"] = "resource.k8s.io/v1beta1"
    problems = validate_object(claim)
    assert [(p.field, p.reason) for p in problems] == [("apiVersion", UNSUPPORTED)]
    assert problems[0].fix == "apiVersion: resource.k8s.io/v1"
    assert "exactly" in problems[0].message


def test_missing_metadata(build):
    claim = build.claim()
    del claim["metadata"]
    problems = validate_object(claim)
    assert [p.field for p in problems] == ["metadata.name"]


def pod(claims, container_claims):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vllm"},
            "spec": {"resourceClaims": claims,
                     "containers": [{"name": "c", "image": "x", "resources": {"claims": container_claims}}]}}


def test_pod_claim_references():
    assert validate_object(pod([{"name": "gpu", "resourceClaimName": "c"}], [{"name": "gpu"}])) == []
    problems = validate_object(pod([{"name": "gpu", "resourceClaimName": "c"}], [{"name": "tpu"}]))
    assert [(p.field, p.reason) for p in problems] == [("spec.containers[0].resources.claims[0]", "Not found")]
    assert problems[0].fix == "name: gpu"
    problems = validate_object(pod([{"name": "gpu"}, {"name": "gpu", "resourceClaimName": "a",
                                                      "resourceClaimTemplateName": "b"}], []))
    assert [(p.field, p.reason) for p in problems] == [
        ("spec.resourceClaims[0]", "Invalid value"), ("spec.resourceClaims[1]", "Invalid value"),
        ("spec.resourceClaims[1].name", "Duplicate value")]


def test_node_is_accepted():
    assert validate_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}}) == []


def test_finalizers_owner_references_and_generation(build):
    claim = build.claim()
    claim["metadata"].update(
        finalizers=["x", "example.com/keep", "kubernetes", "orphan", "foregroundDeletion"],
        ownerReferences=[{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u1", "controller": True},
                         {"apiVersion": "v1", "kind": "Pod", "name": "q", "uid": "u2", "controller": True},
                         {"kind": "Pod"}],
        generation=-1,
    )
    problems = validate_object(claim)
    assert [p.field for p in problems] == [
        "metadata.generation", "metadata.finalizers[0]", "metadata.finalizers",
        "metadata.ownerReferences[2].apiVersion", "metadata.ownerReferences[2].name",
        "metadata.ownerReferences[2].uid", "metadata.ownerReferences"]
    assert problems[1].fix == "example.com/x"


def test_generate_name_is_checked_except_on_classes(build):
    claim = build.claim()
    claim["metadata"]["generateName"] = "Bad_"
    assert [p.field for p in validate_object(claim)] == ["metadata.generateName"]
    cls = build.device_class()
    cls["metadata"]["generateName"] = "Bad_"
    assert validate_object(cls) == []


def test_class_generate_name_with_a_slash_is_reported_only_on_an_otherwise_valid_class(build):
    cls = build.device_class()
    cls["metadata"]["generateName"] = "a/b"
    assert [p.field for p in validate_object(cls)] == ["metadata.generateName"]
    cls["spec"]["config"] = [{}]
    assert [p.field for p in validate_object(cls)] == ["spec.config[0].opaque"]
