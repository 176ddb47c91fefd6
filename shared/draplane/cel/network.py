"""Kubernetes' CEL ip and cidr libraries (k8s.io/apiserver/pkg/cel/library/ip.go, cidr.go).

Addresses follow Go's net/netip: strict dotted IPv4 (no leading zeros), IPv6 without zones, and
IPv4-mapped IPv6 addresses refused. A value travels through the C++ runtime as tagged bytes of its
canonical text (values.py), so CEL's own `==` is netip's `==`.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache

from .errors import CELFunctionError
from .values import CIDR_TAG, IP_TAG

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

_LINK_LOCAL_MULTICAST_V4 = ipaddress.ip_network("224.0.0.0/24")
_BROADCAST_V4 = ipaddress.IPv4Address("255.255.255.255")


@lru_cache(maxsize=4096)
def parse_ip(text: str) -> Address:
    """netip.ParseAddr plus Kubernetes' refusals; CELFunctionError with Kubernetes' message."""
    if "%" in text:
        try:
            ipaddress.ip_address(text)
        except ValueError:
            raise CELFunctionError(f"IP Address {_go_quote(text)} parse error during conversion from string: "
                                   f"ParseAddr({_go_quote(text)}): unable to parse IP") from None
        raise CELFunctionError(f"IP address {_go_quote(text)} with zone value is not allowed")
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        raise CELFunctionError(f"IP Address {_go_quote(text)} parse error during conversion from string: "
                               f"ParseAddr({_go_quote(text)}): unable to parse IP") from None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        raise CELFunctionError(f"IPv4-mapped IPv6 address {_go_quote(text)} is not allowed")
    return address


@lru_cache(maxsize=4096)
def parse_cidr(text: str) -> tuple[Address, int]:
    """netip.ParsePrefix: an address (not necessarily masked), "/" and a decimal prefix length."""
    address_text, slash, bits_text = text.partition("/")
    problem = f"network address parse error during conversion from string: network address parse error during conversion from string: netip.ParsePrefix({_go_quote(text)})"
    if not slash:
        raise CELFunctionError(f"{problem}: no '/'")
    if "%" in address_text:
        raise CELFunctionError(f"{problem}: IPv6 zones cannot be present in a prefix")
    try:
        address = ipaddress.ip_address(address_text)
    except ValueError:
        raise CELFunctionError(f"{problem}: ParseAddr({_go_quote(address_text)}): unable to parse IP") from None
    if not bits_text.isdigit() or not bits_text.isascii() or (len(bits_text) > 1 and bits_text[0] == "0"):
        raise CELFunctionError(f"{problem}: bad bits after slash: {_go_quote(bits_text)}")
    bits = int(bits_text)
    if bits > address.max_prefixlen:
        raise CELFunctionError(f"{problem}: prefix length out of range")
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        raise CELFunctionError(
            f"network address parse error during conversion from string: IPv4-mapped IPv6 address {_go_quote(text)} is not allowed"
        )
    return address, bits


def _go_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def encode_ip(address: Address) -> bytes:
    return IP_TAG + str(address).encode()


def encode_cidr(address: Address, bits: int) -> bytes:
    return CIDR_TAG + f"{address}/{bits}".encode()


def _bytes(value: object) -> bytes | None:
    if isinstance(value, bytearray):
        return bytes(value)
    return value if isinstance(value, bytes) else None


def decode_ip(value: object, function: str) -> Address:
    encoded = _bytes(value)
    if encoded is None or not encoded.startswith(IP_TAG):
        raise CELFunctionError(f"no such overload: {function}")
    return _decode_ip_text(encoded[len(IP_TAG):].decode())


def decode_cidr(value: object, function: str) -> tuple[Address, int]:
    encoded = _bytes(value)
    if encoded is None or not encoded.startswith(CIDR_TAG):
        raise CELFunctionError(f"no such overload: {function}")
    address_text, _, bits = encoded[len(CIDR_TAG):].decode().partition("/")
    return _decode_ip_text(address_text), int(bits)


@lru_cache(maxsize=4096)
def _decode_ip_text(text: str) -> Address:
    return ipaddress.ip_address(text)


# --- the functions --------------------------------------------------------------------------------


def string_to_ip(text: str) -> bytes:
    return encode_ip(parse_ip(text))


def is_ip(text: str) -> bool:
    try:
        parse_ip(text)
    except CELFunctionError:
        return False
    return True


def ip_is_canonical(text: str) -> bool:
    return str(parse_ip(text)) == text


def ip_family(value: bytes) -> int:
    return decode_ip(value, "family").version


def ip_is_unspecified(value: bytes) -> bool:
    return decode_ip(value, "isUnspecified").is_unspecified


def ip_is_loopback(value: bytes) -> bool:
    return decode_ip(value, "isLoopback").is_loopback


def ip_is_link_local_multicast(value: bytes) -> bool:
    address = decode_ip(value, "isLinkLocalMulticast")
    if address.version == 4:
        return address in _LINK_LOCAL_MULTICAST_V4
    return (int(address) >> 112) & 0xFF0F == 0xFF02


def ip_is_link_local_unicast(value: bytes) -> bool:
    return decode_ip(value, "isLinkLocalUnicast").is_link_local


def ip_is_global_unicast(value: bytes) -> bool:
    """netip's IsGlobalUnicast: private ranges count; unspecified, loopback, multicast, link-local
    unicast and the IPv4 broadcast address do not."""
    address = decode_ip(value, "isGlobalUnicast")
    if address == _BROADCAST_V4:
        return False
    return not (address.is_unspecified or address.is_loopback or address.is_multicast or address.is_link_local)


def net_to_string(value: bytes) -> str:
    encoded = _bytes(value)
    if encoded is not None and encoded.startswith(IP_TAG):
        return encoded[len(IP_TAG):].decode()
    if encoded is not None and encoded.startswith(CIDR_TAG):
        return encoded[len(CIDR_TAG):].decode()
    raise CELFunctionError("no such overload: string")


def string_to_cidr(text: str) -> bytes:
    return encode_cidr(*parse_cidr(text))


def is_cidr(text: str) -> bool:
    try:
        parse_cidr(text)
    except CELFunctionError:
        return False
    return True


def _contains(prefix: tuple[Address, int], address: Address) -> bool:
    network_address, bits = prefix
    if network_address.version != address.version:
        return False
    network = ipaddress.ip_network(f"{network_address}/{bits}", strict=False)
    return address in network


def cidr_contains_ip(value: bytes, other: bytes | str) -> bool:
    prefix = decode_cidr(value, "containsIP")
    address = parse_ip(other) if isinstance(other, str) else decode_ip(other, "containsIP")
    return _contains(prefix, address)


def cidr_contains_cidr(value: bytes, other: bytes | str) -> bool:
    prefix = decode_cidr(value, "containsCIDR")
    inner = parse_cidr(other) if isinstance(other, str) else decode_cidr(other, "containsCIDR")
    if prefix[0].version != inner[0].version:
        return False
    outer_network = ipaddress.ip_network(f"{prefix[0]}/{prefix[1]}", strict=False)
    inner_network = ipaddress.ip_network(f"{inner[0]}/{inner[1]}", strict=False)
    # netip: Overlaps and the outer prefix is no longer than the inner one.
    return outer_network.overlaps(inner_network) and prefix[1] <= inner[1]


def cidr_ip(value: bytes) -> bytes:
    return encode_ip(decode_cidr(value, "ip")[0])


def cidr_prefix_length(value: bytes) -> int:
    return decode_cidr(value, "prefixLength")[1]


def cidr_masked(value: bytes) -> bytes:
    address, bits = decode_cidr(value, "masked")
    return encode_cidr(ipaddress.ip_network(f"{address}/{bits}", strict=False).network_address, bits)
