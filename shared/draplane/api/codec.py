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
from draplane.api.storage import (
    CSIDriver, CSINode, PersistentVolume, PersistentVolumeClaim, StorageClass, VolumeAttachment,
)
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
    ("v1", "PersistentVolumeClaim"): PersistentVolumeClaim,
    ("v1", "PersistentVolume"): PersistentVolume,
    ("storage.k8s.io/v1", "StorageClass"): StorageClass,
    ("storage.k8s.io/v1", "CSINode"): CSINode,
    ("storage.k8s.io/v1", "CSIDriver"): CSIDriver,
    ("storage.k8s.io/v1", "VolumeAttachment"): VolumeAttachment,
}

_json_encoder = msgspec.json.Encoder()


# Limits on what one YAML document may make the readers after the parser do. Deeper than any
# Kubernetes object (a ResourceClaim is about 10 levels; opaque parameters rarely add 10 more) and
# shallow enough that every recursive reader (the composer, validation, msgspec) stays well within
# Python's recursion limit. An alias is a reference, not a copy, but everything after the loader
# walks the document as a tree: a few lines of anchors ("billion laughs") become 10**9 nodes.
MAX_DEPTH = 100
MAX_ALIAS_EXPANSION = 100_000
# Every Kubernetes integer field is int64 (or uint64 in a few places); Go's YAML reads a longer
# integer as a float.
_INT_RANGE = (-(2**63), 2**64 - 1)
_SURROGATE = re.compile("[\ud800-\udfff]")


class YamlLimitError(yaml.composer.ComposerError):
    """A document that is valid YAML but beyond what draplane reads (depth, aliases)."""


class KubernetesYamlLoader(yaml.SafeLoader):
    """YAML as kubectl and the apiserver read it (sigs.k8s.io/yaml, which is YAML 1.1).

    PyYAML already reads yes/no/on/off as booleans, but not y/Y/n/N, which Go's YAML does: a
    `name: n` that PyYAML keeps as a string is `false` to kubectl, which then rejects the object.
    Timestamps stay the strings they were written as, as they do on their way to JSON there.

    kubectl turns the YAML into JSON before anything reads it, so what comes out here is JSON's
    types only: a `!!set` is a mapping to nulls, `!!omap` and `!!pairs` are lists of one-key
    mappings, `!!binary` is the decoded text, and number and boolean keys are strings ("1", "true").
    It also refuses what would make its readers recurse or loop without bound: documents nested
    more than MAX_DEPTH levels, an anchor whose value contains an alias of itself, and aliases
    that stand for more than MAX_ALIAS_EXPANSION nodes in all.
    """

    bool_values = {**yaml.SafeLoader.bool_values, "y": True, "n": False}
    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    # --- composing: depth and aliases ---------------------------------------------------------

    def compose_document(self):
        self._depth = 0
        self._open_anchors: set[str] = set()
        self._alias_expansion = 0
        self._node_sizes: dict[int, tuple[int, int]] = {}
        return super().compose_document()

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open_anchors:
                raise YamlLimitError(None, None, f"the value of anchor {event.anchor!r} contains itself",
                                     event.start_mark)
            node = super().compose_node(parent, index)
            size, depth = self._measure(node)
            self._alias_expansion += size
            if self._alias_expansion > MAX_ALIAS_EXPANSION:
                raise YamlLimitError(
                    None, None, f"the document's aliases expand to more than {MAX_ALIAS_EXPANSION:,} nodes "
                    "(a YAML bomb?); write the repeated parts out", event.start_mark)
            if self._depth + depth > MAX_DEPTH:
                raise YamlLimitError(None, None, f"the document is nested more than {MAX_DEPTH} levels deep "
                                     f"(through alias {event.anchor!r})", event.start_mark)
            return node
        collection = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
        if collection:
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise YamlLimitError(None, None, f"the document is nested more than {MAX_DEPTH} levels deep",
                                     event.start_mark)
        if event.anchor is not None:
            self._open_anchors.add(event.anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._open_anchors.discard(event.anchor)
            if collection:
                self._depth -= 1

    def _measure(self, node: yaml.Node) -> tuple[int, int]:
        """(nodes, levels of collections) in `node` with every alias in it expanded; memoized, as
        aliased nodes are shared."""
        measured = self._node_sizes.get(id(node))
        if measured is None:
            if isinstance(node, yaml.SequenceNode):
                children = [self._measure(child) for child in node.value]
            elif isinstance(node, yaml.MappingNode):
                children = [self._measure(n) for pair in node.value for n in pair]
            else:
                children = None
            if children is None:
                measured = (1, 0)
            else:
                measured = (1 + sum(size for size, _ in children), 1 + max((depth for _, depth in children), default=0))
            self._node_sizes[id(node)] = measured
        return measured

    # --- constructing: JSON's types only --------------------------------------------------------

    def construct_scalar(self, node):
        value = super().construct_scalar(node)
        if isinstance(value, str) and _SURROGATE.search(value):
            # JSON writes a character beyond U+FFFF as two escapes ("\\ud83d\\udca5"); PyYAML keeps
            # them as two halves, which no encoder takes. A half without its pair is no character.
            try:
                value = value.encode("utf-16", "surrogatepass").decode("utf-16")
            except UnicodeDecodeError:
                raise yaml.constructor.ConstructorError(
                    None, None, "an escape of half a UTF-16 surrogate pair is not a character", node.start_mark) from None
        return value

    def construct_mapping(self, node, deep=False):
        # PyYAML's own, with each key made a string before it goes in: as Python keys, 1 and true
        # are one key, and a list or mapping is no key at all.
        if not isinstance(node, yaml.MappingNode):
            raise yaml.constructor.ConstructorError(None, None, f"expected a mapping, found {node.id}", node.start_mark)
        self.flatten_mapping(node)
        mapping = {}
        for key_node, value_node in node.value:
            key = self._json_key(self.construct_object(key_node, deep=deep), key_node)
            mapping[key] = self.construct_object(value_node, deep=deep)
        return mapping

    @staticmethod
    def _json_key(key: Any, node: yaml.Node) -> str:
        if isinstance(key, str):
            return key
        if isinstance(key, bool):
            return "true" if key else "false"
        if isinstance(key, (int, float)):
            return repr(key)
        raise yaml.constructor.ConstructorError(
            None, None, f"a mapping key must be a string, number or boolean, not {_yaml_type(key)}", node.start_mark)

    def construct_yaml_int(self, node):
        value = self._scalar(super().construct_yaml_int, node, "an integer")
        if _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            return value
        try:
            return float(value)
        except OverflowError:
            raise yaml.constructor.ConstructorError(
                None, None, f"integer {_excerpt(node.value)} is out of range", node.start_mark) from None

    def construct_yaml_float(self, node):
        return self._scalar(super().construct_yaml_float, node, "a number")

    def construct_yaml_bool(self, node):
        return self._scalar(super().construct_yaml_bool, node, "a boolean")

    @staticmethod
    def _scalar(construct, node, what: str):
        """An explicitly tagged scalar (`!!int abc`) that is not what its tag says is a YAML error;
        so is an integer of more digits than int() converts (sys.get_int_max_str_digits)."""
        try:
            return construct(node)
        except (ValueError, IndexError, KeyError):
            digits = node.value.lstrip("+-").isdigit()
            problem = f"integer {_excerpt(node.value)} is out of range" if digits else \
                f"{_excerpt(node.value)} is not {what} ({node.tag.rsplit(':', 1)[-1]})"
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None

    def construct_yaml_set(self, node):
        data: dict = {}
        yield data
        data.update(dict.fromkeys(self.construct_mapping(node)))

    def construct_yaml_pairs(self, node):
        pairs: list = []
        yield pairs
        if not isinstance(node, yaml.SequenceNode):
            raise yaml.constructor.ConstructorError(None, None, f"{node.tag} must be a sequence", node.start_mark)
        for item in node.value:
            if not isinstance(item, yaml.MappingNode) or len(item.value) != 1:
                raise yaml.constructor.ConstructorError(
                    None, None, f"each item of {node.tag} must be a mapping of one key", item.start_mark)
            pairs.append(self.construct_mapping(item))

    def construct_yaml_binary(self, node):
        # Go's YAML decodes !!binary into a string of its bytes; JSON then replaces invalid UTF-8.
        return super().construct_yaml_binary(node).decode("utf-8", errors="replace")

    def construct_yaml_timestamp(self, node):
        return self.construct_scalar(node)


for _tag, _constructor in [
    ("int", KubernetesYamlLoader.construct_yaml_int),
    ("float", KubernetesYamlLoader.construct_yaml_float),
    ("bool", KubernetesYamlLoader.construct_yaml_bool),
    ("set", KubernetesYamlLoader.construct_yaml_set),
    ("omap", KubernetesYamlLoader.construct_yaml_pairs),
    ("pairs", KubernetesYamlLoader.construct_yaml_pairs),
    ("binary", KubernetesYamlLoader.construct_yaml_binary),
    ("timestamp", KubernetesYamlLoader.construct_yaml_timestamp),
]:
    KubernetesYamlLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _constructor)
KubernetesYamlLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"), list("yYnN"))


def _excerpt(text: str) -> str:
    return repr(text) if len(text) <= 24 else f"{text[:20]!r}... ({len(text)} characters)"


def _yaml_type(value: Any) -> str:
    return "null" if value is None else {list: "a sequence", dict: "a mapping"}.get(type(value), type(value).__name__)


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
    kind = raw.get("kind") if isinstance(raw.get("kind"), str) and raw.get("kind") else "object"
    meta = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
    name = next((n for n in (meta.get("name"), meta.get("generateName")) if isinstance(n, str) and n), "<unnamed>")
    ns = meta.get("namespace") if isinstance(meta.get("namespace"), str) else None
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
    for field, value in (("apiVersion", api_version), ("kind", kind)):
        if not isinstance(value, str):
            raise DecodeError(f"{where}{_describe(raw)}: field {field}: expected a string, got {_yaml_type(value)}")
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
