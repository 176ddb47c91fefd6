"""List-then-watch, as kopf does it: remember the resourceVersion, watch with bookmarks, and go
back to a fresh list on 410 Gone, reporting objects that vanished in between as deletions."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from typing import AsyncIterator, Generic, TypeVar

import aiohttp
import msgspec

from draplane.kube.client import KubeApiError, KubeClient, kind_of
from draplane.structured_logs import error_text

log = logging.getLogger(__name__)
T = TypeVar("T", bound=msgspec.Struct)


@dataclasses.dataclass(frozen=True, slots=True)
class WatchEvent(Generic[T]):
    type: str  # ADDED | MODIFIED | DELETED | SYNCED (the initial or a re-list is complete)
    object: T | None


class _RawEvent(msgspec.Struct):
    type: str
    object: msgspec.Raw


class _Meta(msgspec.Struct):
    resourceVersion: str = ""
    name: str = ""
    namespace: str = ""


class _Object(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)


class _Bookmark(msgspec.Struct):
    metadata: _Meta


def _key(obj: msgspec.Struct) -> tuple[str, str]:
    return (obj.metadata.namespace or "", obj.metadata.name or "")


async def watch_objects(
    client: KubeClient, model: type[T], namespace: str | None = None, *,
    label_selector: str | None = None, field_selector: str | None = None,
    timeout_seconds: int = 300,
) -> AsyncIterator[WatchEvent[T]]:
    """Every change to objects of one kind, forever. Cancel the consuming task to stop."""
    kind = kind_of(model)
    decoder = msgspec.json.Decoder(model)
    event_decoder = msgspec.json.Decoder(_RawEvent)
    bookmark_decoder = msgspec.json.Decoder(_Bookmark)
    # The last object seen per key: a re-list that lacks one means it was deleted while we were not
    # watching, and the consumer gets that last state as the deletion (like an informer's tombstone).
    known: dict[tuple[str, str], T] = {}
    failures = 0

    def undecodable(data: bytes, exc: msgspec.ValidationError) -> None:
        # One object draplane's model cannot hold must not stop the watch of every other one
        # (a kubelet's CSINode with `drivers: null` once stopped the binder's): it is left out,
        # named, with the field.
        try:
            meta = msgspec.json.decode(data, type=_Object).metadata
        except msgspec.DecodeError:
            meta = _Meta()
        where = f"{meta.namespace}/{meta.name}" if meta.namespace else meta.name or "(unnamed)"
        log.error("%s %s left out: it does not decode as draplane reads it: %s", kind.plural, where, exc)

    while True:
        try:
            items, resource_version = await client.list(
                model, namespace, label_selector=label_selector, field_selector=field_selector,
                undecodable=undecodable,
            )
        except KubeApiError as exc:
            failures += 1
            log.warning("listing %s failed (%s); retrying", kind.plural, error_text(exc))
            await asyncio.sleep(min(10.0, 0.2 * 2**failures) * (1 + random.random() * 0.2))
            continue
        listed = {_key(item): item for item in items}
        for key in [k for k in known if k not in listed]:
            yield WatchEvent("DELETED", known.pop(key))
        for key, item in listed.items():
            previous = known.get(key)
            if previous is None or previous.metadata.resource_version != item.metadata.resource_version:
                known[key] = item
                yield WatchEvent("MODIFIED" if previous is not None else "ADDED", item)
        yield WatchEvent("SYNCED", None)

        while True:
            query = {
                "watch": "true", "allowWatchBookmarks": "true", "resourceVersion": resource_version,
                "timeoutSeconds": timeout_seconds, "labelSelector": label_selector, "fieldSelector": field_selector,
            }
            try:
                async for line in client.stream_lines(kind.path(namespace), query=query, timeout=timeout_seconds + 30):
                    event = event_decoder.decode(line)
                    if event.type == "BOOKMARK":
                        resource_version = bookmark_decoder.decode(event.object).metadata.resourceVersion or resource_version
                        continue
                    if event.type == "ERROR":
                        status = msgspec.json.decode(event.object)
                        if status.get("code") == 410:
                            raise KubeApiError(410, "Expired", status.get("message", ""), "WATCH", kind.path(namespace))
                        raise KubeApiError(status.get("code", 500), status.get("reason", ""), status.get("message", ""), "WATCH", kind.path(namespace))
                    try:
                        obj = decoder.decode(event.object)
                    except msgspec.ValidationError as exc:
                        undecodable(bytes(event.object), exc)
                        # the version the consumer holds is no longer the object's: gone for it
                        try:
                            meta = msgspec.json.decode(event.object, type=_Object).metadata
                        except msgspec.DecodeError:
                            continue  # not even a name and a version: nothing to say of it
                        resource_version = meta.resourceVersion or resource_version
                        gone = known.pop((meta.namespace, meta.name), None)
                        if gone is not None:
                            yield WatchEvent("DELETED", gone)
                        continue
                    resource_version = obj.metadata.resource_version or resource_version
                    key = _key(obj)
                    if event.type == "DELETED":
                        known.pop(key, None)
                    else:
                        known[key] = obj
                    yield WatchEvent(event.type, obj)
                failures = 0
            except KubeApiError as exc:
                if exc.is_gone:
                    log.info("watch of %s expired (410); re-listing", kind.plural)
                    break
                failures += 1
                log.warning("watch of %s failed (%s); re-listing", kind.plural, error_text(exc))
                await asyncio.sleep(min(10.0, 0.2 * 2**failures))
                break
            # aiohttp.ClientError too: an apiserver that stops mid-watch ends the chunked stream
            # early (ClientPayloadError) or hangs up (ServerDisconnectedError), neither an OSError;
            # let out, they ended the generator and, with it, what it knew for the tombstones
            except (OSError, aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError) as exc:
                failures += 1
                log.warning("watch of %s broke (%s); resuming", kind.plural, exc)
                await asyncio.sleep(min(10.0, 0.2 * 2**failures))
