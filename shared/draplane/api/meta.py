"""ObjectMeta and the other apimachinery types every object carries."""

from __future__ import annotations

from typing import Any

import msgspec


class Base(msgspec.Struct, rename="camel", omit_defaults=True, kw_only=True, gc=False):
    """All API structs: camelCase on the wire, unset fields left out so the apiserver defaults them.

    Not tracked by the cycle collector (gc=False): an API object is a tree of values and never
    refers back to itself, so reference counting frees it. The services hold every object they
    watch and decode more at each event, and every collection walked them all again: a shard dealt
    no pod (bench/e2e.py --follower, 4,000 pods) held 205,000 tracked objects and spent 0.35 s in
    the collector; with the API structs untracked 107,000 and 0.17 s. Nothing may store an object
    inside itself, or anything that refers back to it (a cycle through an untracked struct is
    never collected)."""


class OwnerReference(Base, kw_only=True):
    api_version: str
    kind: str
    name: str
    uid: str
    controller: bool | None = None
    block_owner_deletion: bool | None = None


class ObjectMeta(Base, kw_only=True):
    name: str | None = None
    generate_name: str | None = None
    namespace: str | None = None
    uid: str | None = None
    resource_version: str | None = None
    generation: int | None = None
    creation_timestamp: str | None = None
    deletion_timestamp: str | None = None
    deletion_grace_period_seconds: int | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    owner_references: list[OwnerReference] | None = None
    finalizers: list[str] | None = None
    # Kept opaque: we never interpret it, but a read-modify-write must not drop it.
    managed_fields: list[dict[str, Any]] | None = None


class ListMeta(Base, kw_only=True):
    resource_version: str | None = None
    continue_: str | None = msgspec.field(default=None, name="continue")
    remaining_item_count: int | None = None


class Condition(Base, kw_only=True):
    type: str
    status: str
    last_transition_time: str | None = None
    reason: str | None = None
    message: str | None = None
    observed_generation: int | None = None


class NodeSelectorRequirement(Base, kw_only=True):
    key: str
    operator: str
    values: list[str] | None = None


class NodeSelectorTerm(Base, kw_only=True):
    match_expressions: list[NodeSelectorRequirement] | None = None
    match_fields: list[NodeSelectorRequirement] | None = None


class NodeSelector(Base, kw_only=True):
    node_selector_terms: list[NodeSelectorTerm]
