import pytest

from draplane.api.resource import AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult
from draplane.scheduling import reservations as rv


def reservation(claim: str, *devices: str, expires: float | None = 10.0, share: str | None = None,
                admin: bool | None = None) -> rv.Reservation:
    results = [DeviceRequestAllocationResult(request="r", driver="d", pool="p", device=d, share_id=share,
                                             admin_access=admin) for d in devices]
    allocation = AllocationResult(devices=DeviceAllocationResult(results=results))
    return rv.Reservation(
        claim_uid=claim,
        claim_namespace="ns",
        claim_name=claim,
        pod_uid="pod-" + claim,
        devices=rv.devices_of(allocation),
        allocation=allocation,
        reserved_at=0.0,
        expires_at=expires,
    )


def test_add_rejects_a_device_already_reserved():
    entry = rv.add(rv.NodeReservations(node="n1"), [reservation("a", "gpu-0")])
    with pytest.raises(rv.ReservationConflict, match="d/p/gpu-0 on node n1"):
        rv.add(entry, [reservation("b", "gpu-0")])
    both = rv.add(entry, [reservation("b", "gpu-1")])
    assert set(both.claims) == {"a", "b"}


def test_add_is_idempotent_for_the_same_claim_and_devices():
    entry = rv.add(rv.NodeReservations(node="n1"), [reservation("a", "gpu-0")])
    assert rv.add(entry, [reservation("a", "gpu-0")]).claims.keys() == {"a"}
    with pytest.raises(rv.ReservationConflict, match="already reserved on node n1 with other devices"):
        rv.add(entry, [reservation("a", "gpu-1")])


def test_shares_do_not_conflict_here():
    entry = rv.add(rv.NodeReservations(node="n1"), [reservation("a", "gpu-0", share="s1")])
    entry = rv.add(entry, [reservation("b", "gpu-0", share="s2")])
    assert len(entry.claims) == 2


def test_a_multi_device_reservation_is_the_same_in_any_order():
    # Two results without a share ID used to be compared with `<`, which ReservedDevice lacks.
    entry = rv.add(rv.NodeReservations(node="n1"), [reservation("a", "gpu-0", "gpu-1", "nic-0")])
    again = reservation("a", "nic-0", "gpu-1", "gpu-0")
    assert rv.add(entry, [again]) is entry
    assert rv.same_devices(entry.claims["a"].devices, again.devices)
    assert not rv.same_devices(entry.claims["a"].devices, reservation("a", "gpu-0", "gpu-1").devices)
    mixed = reservation("m", "gpu-0", "gpu-0", share="s1").devices + reservation("m", "gpu-0").devices
    assert rv.same_devices(mixed, list(reversed(mixed)))


def test_admin_access_neither_takes_a_device_nor_is_kept_from_one_in_use():
    entry = rv.add(rv.NodeReservations(node="n1"), [reservation("user", "gpu-0")])
    entry = rv.add(entry, [reservation("admin", "gpu-0", admin=True)])
    entry = rv.add(entry, [reservation("admin2", "gpu-0", "gpu-1", admin=True)])
    # gpu-1 is only watched by an admin: an ordinary claim still gets it
    entry = rv.add(entry, [reservation("user2", "gpu-1")])
    assert set(entry.claims) == {"user", "admin", "admin2", "user2"}
    assert rv.exclusive_devices(entry) == {("d", "p", "gpu-0"), ("d", "p", "gpu-1")}
    with pytest.raises(rv.ReservationConflict):
        rv.add(entry, [reservation("user3", "gpu-1")])


def test_entries_written_before_admin_access_was_recorded_still_decode():
    old = b'{"version":1,"node":"n1","claims":{"a":{"claim_uid":"a","claim_namespace":"ns","claim_name":"a",' \
          b'"pod_uid":"p","devices":[["d","p","gpu-0",null]],"allocation":{},"reserved_at":0,"expires_at":null}}}'
    entry = rv.decode_entry(old, "n1")
    assert entry.claims["a"].devices == [rv.ReservedDevice("d", "p", "gpu-0")]
    assert entry.claims["a"].devices[0].exclusive


def test_prune_drops_lapsed_leases_unless_kubernetes_has_the_allocation():
    entry = rv.add(
        rv.NodeReservations(node="n1"),
        [reservation("lapsed", "gpu-0", expires=5.0), reservation("written", "gpu-1", expires=5.0),
         reservation("live", "gpu-2", expires=50.0), reservation("confirmed", "gpu-3", expires=None)],
    )
    pruned, dropped = rv.prune(entry, now=6.0, claim_is_allocated=lambda uid: uid == "written")
    assert [r.claim_uid for r in dropped] == ["lapsed"]
    assert set(pruned.claims) == {"written", "live", "confirmed"}
    assert pruned.claims["written"].confirmed
    # the lapsed device is free again
    rv.add(pruned, [reservation("next", "gpu-0")])


def test_confirm_extend_release():
    entry = rv.add(rv.NodeReservations(node="n1"), [reservation("a", "gpu-0", expires=5.0)])
    assert rv.extend(entry, "a", 20.0).claims["a"].expires_at == 20.0
    confirmed = rv.confirm(entry, "a")
    assert confirmed.claims["a"].confirmed
    assert rv.confirm(confirmed, "a") is None
    assert rv.extend(confirmed, "a", 30.0) is None
    assert rv.release(confirmed, ["zzz"]) is None
    assert rv.release(confirmed, ["a"]).claims == {}


def test_entry_codec_checks_node_and_version():
    entry = rv.add(rv.NodeReservations(node="n1"), [reservation("a", "gpu-0")])
    assert rv.decode_entry(rv.encode_entry(entry), "n1") == entry
    assert rv.decode_entry(None, "n2") == rv.NodeReservations(node="n2")
    with pytest.raises(ValueError, match="under key n2 names node n1"):
        rv.decode_entry(rv.encode_entry(entry), "n2")
    with pytest.raises(ValueError, match="reservation entry for node n1"):
        rv.decode_entry(b"{not json", "n1")


def pod_reservation(uid: str, cpu: int = 1000, expires: float = 10.0) -> rv.PodReservation:
    return rv.PodReservation(pod_uid=uid, pod_namespace="ns", pod_name=uid, requests={"cpu": cpu},
                             reserved_at=0.0, expires_at=expires)


def test_a_pod_is_reserved_once_and_adding_nothing_new_returns_the_same_entry():
    entry = rv.add(rv.NodeReservations(node="n1"), [reservation("a", "gpu-0")], pod_reservation("p1"))
    assert set(entry.pods) == {"p1"}
    # a redelivered placement: the same claim and pod are there already, nothing to write
    assert rv.add(entry, [reservation("a", "gpu-0")], pod_reservation("p1")) is entry
    # a pod without claims still takes its CPU and memory
    assert set(rv.add(entry, [], pod_reservation("p2")).pods) == {"p1", "p2"}


def test_pod_reservations_lapse_and_are_released_with_their_claims():
    entry = rv.add(rv.NodeReservations(node="n1"), [reservation("a", "gpu-0", expires=50.0)], pod_reservation("p1", expires=5.0))
    entry = rv.add(entry, [], pod_reservation("p2", expires=50.0))
    assert not rv.has_lapsed_claims(entry, now=6.0)  # only a pod lapsed: not worth a write
    pruned, dropped = rv.prune(entry, now=6.0, claim_is_allocated=lambda uid: False)
    assert dropped == [] and set(pruned.pods) == {"p2"} and set(pruned.claims) == {"a"}
    released = rv.release(entry, ["a"], ["p1"])
    assert released.claims == {} and set(released.pods) == {"p2"}
    assert rv.release(entry, ["zzz"], ["nobody"]) is None
    # confirming or renewing a claim keeps the pods
    assert set(rv.confirm(entry, "a").pods) == {"p1", "p2"}
    assert rv.decode_entry(rv.encode_entry(entry), "n1") == entry


def test_an_entry_written_before_pod_reservations_still_reads():
    old = b'{"version":1,"node":"n1","claims":{}}'
    assert rv.decode_entry(old, "n1").pods == {}


def test_decoded_entries_share_what_their_reservations_hold_alike():
    """Every shard holds every node's entry: an adminAccess result that many monitoring pods
    reserve on one GPU, the devices and the pods' requests are one object each, and the entry
    still reads exactly as written."""
    monitors = [reservation(f"m{i}", "gpu-0", admin=True) for i in range(3)]
    entry = rv.add(rv.NodeReservations(node="n1"), [reservation("a", "gpu-0"), reservation("b", "gpu-1"), *monitors])
    entry = rv.add(entry, [], pod_reservation("pod-a"))
    entry = rv.add(entry, [], pod_reservation("pod-b"))
    encoded = rv.encode_entry(entry)
    first, second = rv.decode_entry(encoded, "n1"), rv.decode_entry(encoded, "n1")
    assert first == entry and second == entry
    m0, m1, m2 = (first.claims[f"m{i}"] for i in range(3))
    assert m0.allocation is m1.allocation is m2.allocation is second.claims["m0"].allocation
    assert first.claims["a"].allocation is not first.claims["b"].allocation
    assert first.claims["a"].devices[0] is second.claims["a"].devices[0]
    assert first.pods["pod-a"].requests is first.pods["pod-b"].requests
    # a field that repeats its key is the key's string (not a copy of it)
    assert first.claims["a"].pod_uid is next(uid for uid in first.pods if uid == "pod-a")


def test_decoded_entries_do_not_share_what_differs():
    entry = rv.add(rv.NodeReservations(node="n1"), [reservation("a", "gpu-0", admin=True),
                                                     reservation("b", "gpu-0", share="s1")])
    entry = rv.add(entry, [], pod_reservation("pod-a", cpu=1000))
    entry = rv.add(entry, [], pod_reservation("pod-b", cpu=2000))
    decoded = rv.decode_entry(rv.encode_entry(entry), "n1")
    assert decoded == entry
    a, b = decoded.claims["a"], decoded.claims["b"]
    assert a.allocation is not b.allocation and a.devices[0] is not b.devices[0]
    assert decoded.pods["pod-a"].requests == {"cpu": 1000} and decoded.pods["pod-b"].requests == {"cpu": 2000}


def test_the_entry_decoder_reads_as_decode_entry_and_decodes_only_what_changed():
    """Each write of a node's entry carries its other reservations as they were: those are the
    objects read before; a renewed, confirmed or new one is decoded anew."""
    decoder = rv.EntryDecoder()
    entry = rv.add(rv.NodeReservations(node="n1"), [reservation("a", "gpu-0"), reservation("b", "gpu-1")],
                   pod_reservation("pod-a"))
    first = decoder.decode(rv.encode_entry(entry), "n1")
    assert first == rv.decode_entry(rv.encode_entry(entry), "n1") == entry

    entry = rv.add(rv.confirm(entry, "a"), [reservation("c", "gpu-2")], pod_reservation("pod-c"))
    second = decoder.decode(rv.encode_entry(entry), "n1")
    assert second == rv.decode_entry(rv.encode_entry(entry), "n1") == entry
    assert second.claims["b"] is first.claims["b"] and second.pods["pod-a"] is first.pods["pod-a"]
    assert second.claims["a"] is not first.claims["a"] and second.claims["a"].confirmed
    # decoded anew, its parts are still the ones others hold alike
    assert second.claims["c"].devices[0] is rv.decode_entry(rv.encode_entry(entry), "n1").claims["c"].devices[0]

    # another node's entry with the same bytes is decoded on its own
    other = rv.NodeReservations(node="n2", claims={"b": entry.claims["b"]})
    assert decoder.decode(rv.encode_entry(other), "n2").claims["b"] is not second.claims["b"]
    # a deleted key is an empty entry, and nothing of it is remembered
    assert decoder.decode(None, "n1") == rv.NodeReservations(node="n1")
    assert decoder.decode(rv.encode_entry(entry), "n1").claims["b"] is not second.claims["b"]
    assert len(decoder) == 2


def test_the_entry_decoder_compares_with_the_entry_read_before_its_readers_own_writes():
    """A reader's own write is not recorded: the next entry is compared with the one read before
    it, and only what changed since is decoded."""
    decoder = rv.EntryDecoder()
    read = decoder.decode(rv.encode_entry(rv.add(rv.NodeReservations(node="n1"), [reservation("a", "gpu-0")],
                                                 pod_reservation("pod-a"))), "n1")
    written = rv.add(read, [reservation("b", "gpu-1")])  # this reader's own write, never decoded
    after = rv.add(written, [reservation("c", "gpu-2")])  # another's write on top of it
    again = decoder.decode(rv.encode_entry(after), "n1")
    assert again == after
    assert again.claims["a"] is read.claims["a"] and again.pods["pod-a"] is read.pods["pod-a"]
    assert again.claims["b"] is not written.claims["b"]


def test_the_entry_decoder_names_what_it_cannot_read_and_keeps_what_it_knew():
    decoder = rv.EntryDecoder()
    entry = rv.add(rv.NodeReservations(node="n1"), [reservation("a", "gpu-0")])
    good = decoder.decode(rv.encode_entry(entry), "n1")
    with pytest.raises(ValueError, match="reservation entry for node n1"):
        decoder.decode(b"{not json", "n1")
    with pytest.raises(ValueError, match="under key n1 names node n2"):
        decoder.decode(rv.encode_entry(rv.NodeReservations(node="n2")), "n1")
    with pytest.raises(ValueError, match="field version is 2, expected 1"):
        decoder.decode(b'{"version":2,"node":"n1"}', "n1")
    bad_claim = b'{"version":1,"node":"n1","claims":{"x":{"claim_uid":"x"}}}'
    with pytest.raises(ValueError, match="reservation entry for node n1: claim x: Object missing required field"):
        decoder.decode(bad_claim, "n1")
    bad_pod = b'{"version":1,"node":"n1","pods":{"p":{"pod_uid":7}}}'
    with pytest.raises(ValueError, match="reservation entry for node n1: pod p: Expected `str`"):
        decoder.decode(bad_pod, "n1")
    # what it read last still stands for the next entry
    again = decoder.decode(rv.encode_entry(rv.add(entry, [reservation("b", "gpu-1")])), "n1")
    assert again.claims["a"] is good.claims["a"]
    # an entry written before pod reservations existed still reads
    assert decoder.decode(b'{"version":1,"node":"n1","claims":{}}', "n1").pods == {}
