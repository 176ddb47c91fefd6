"""Decode Kubernetes objects (YAML or JSON, one or many documents, `List` kinds) into typed models.

The one place where untyped input becomes typed: everything past this works on msgspec Structs.
Errors name the document, the object and the field, because that is what a user has to fix.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Iterator, TypeVar

import msgspec
import yaml

from draplane.api.core import Node, Pod
from draplane.api.resource import DeviceClass, DeviceTaintRule, ResourceClaim, ResourceClaimTemplate, ResourceSlice

T = TypeVar("T", bound=msgspec.Struct)

# (apiVersion, kind) -> model. Only the versions we model exactly are accepted; anything else is
# reported by name rather than half-read.
MODELS: dict[tuple[str, str], type[msgspec.Struct]] = {
    ("resource.k8s.io/v1", "DeviceClass"): DeviceClass,
    ("resource.k8s.io/v1", "ResourceSlice"): ResourceSlice,
    ("resource.k8s.io/v1", "ResourceClaim"): ResourceClaim,
    ("resource.k8s.io/v1", "ResourceClaimTemplate"): ResourceClaimTemplate,
    ("resource.k8s.io/v1", "DeviceTaintRule"): DeviceTaintRule,
    ("v1", "Node"): Node,
    ("v1", "Pod"): Pod,
}

_json_encoder = msgspec.json.Encoder()


class KubernetesYamlLoader(yaml.SafeLoader):
    """YAML as kubectl and the apiserver read it (sigs.k8s.io/yaml, which is YAML 1.1).

    PyYAML already reads yes/no/on/off as booleans, but not y/Y/n/N, which Go's YAML does: a
    `name: n` that PyYAML keeps as a string is `false` to kubectl, which then rejects the object.
    Timestamps stay the strings they were written as, as they do on their way to JSON there.
    """

    bool_values = {**yaml.SafeLoader.bool_values, "y": True, "n": False}
    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }


KubernetesYamlLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"), list("yYnN"))


def load_yaml_documents(text: str) -> list[Any]:
    """Every document of a YAML (or JSON) text, read as Kubernetes reads it; empty ones dropped."""
    return [d for d in yaml.load_all(text, Loader=KubernetesYamlLoader) if d is not None]


class DecodeError(ValueError):
    """Input that is not a Kubernetes object we understand. The message names where and what."""


def encode_json(obj: msgspec.Struct) -> bytes:
    return _json_encoder.encode(obj)


def to_dict(obj: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(obj)


def decode_json(data: bytes | str, model: type[T]) -> T:
    return msgspec.json.decode(data, type=model)


def convert(raw: dict[str, Any], model: type[T], *, where: str = "") -> T:
    try:
        return msgspec.convert(raw, type=model)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"{where}{_describe(raw)}: {_field_message(exc)}") from None


def _describe(raw: Any) -> str:
    if not isinstance(raw, dict):
        return "document"
    kind = raw.get("kind", "object")
    meta = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
    name = meta.get("name") or meta.get("generateName") or "<unnamed>"
    ns = meta.get("namespace")
    return f"{kind} {ns + '/' if ns else ''}{name}"


def _field_message(exc: msgspec.ValidationError) -> str:
    # msgspec says "Expected `str`, got `int` - at `$.spec.devices[0].name`"; lead with the field.
    text = str(exc)
    if " - at `$" in text:
        message, path = text.rsplit(" - at `$", 1)
        return f"field {path.rstrip('`').lstrip('.')}: {message}"
    return text


def decode_object(raw: Any, *, where: str = "") -> msgspec.Struct:
    if not isinstance(raw, dict):
        raise DecodeError(f"{where}expected a Kubernetes object (a mapping), got {type(raw).__name__}")
    api_version, kind = raw.get("apiVersion"), raw.get("kind")
    if not kind or not api_version:
        raise DecodeError(f"{where}{_describe(raw)}: not a Kubernetes object (apiVersion and kind are required)")
    model = MODELS.get((api_version, kind))
    if model is None:
        known = ", ".join(sorted({k for _, k in MODELS}))
        if kind in {k for _, k in MODELS}:
            raise DecodeError(
                f"{where}{_describe(raw)}: apiVersion {api_version!r} is not supported for {kind}; "
                f"use {next(v for v, k in MODELS if k == kind)}"
            )
        raise DecodeError(f"{where}{_describe(raw)}: kind {kind!r} is not one draplane reads (it reads {known})")
    if not isinstance(raw.get("metadata"), dict):
        raise DecodeError(f"{where}{_describe(raw)}: field metadata is required")
    return convert(raw, model, where=where)


def iter_documents(text: str, *, source: str = "<input>") -> Iterator[tuple[str, Any]]:
    """(location, raw document) for each document; `List` kinds are flattened."""
    try:
        docs = load_yaml_documents(text)
    except yaml.YAMLError as exc:
        raise DecodeError(f"{source}: not valid YAML or JSON: {exc}".replace("\n", " ")) from None
    for index, doc in enumerate(docs):
        where = f"{source} document {index + 1}: "
        if isinstance(doc, dict) and isinstance(doc.get("kind"), str) and doc["kind"].endswith("List") and "items" in doc:
            items = doc["items"] or []
            if not isinstance(items, list):
                raise DecodeError(f"{where}{doc['kind']}: field items must be a list")
            for item_index, item in enumerate(items):
                yield f"{where}items[{item_index}]: ", item
        else:
            yield where, doc


def load_objects(texts: Iterable[tuple[str, str]]) -> list[msgspec.Struct]:
    """Typed objects from (source name, text) pairs."""
    objects = []
    for source, text in texts:
        for where, raw in iter_documents(text, source=source):
            objects.append(decode_object(raw, where=where))
    return objects


def load_files(paths: Iterable[str | Path]) -> list[msgspec.Struct]:
    pairs = []
    for path in paths:
        try:
            pairs.append((str(path), Path(path).read_text()))
        except OSError as exc:
            raise DecodeError(f"{path}: cannot read: {exc.strerror}") from None
    return load_objects(pairs)
