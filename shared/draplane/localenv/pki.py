"""Throwaway certificate authorities: the local kube-apiserver's (serving, client and SA keys) and NATS' (serving)."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True, slots=True)
class Pki:
    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    service_account_key: Path
    service_account_pub: Path
    # The admin's bearer token and the apiserver's static token file that names it. Clients use the
    # token, not the admin certificate: kube-apiserver caches token authentication but verifies a
    # client certificate's chain (an ECDSA signature check) on every request, which was 12 % of its
    # CPU under bench/e2e.py. In a cluster our services authenticate with tokens too.
    admin_token: Path
    token_file: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def _validity() -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    return now, now + datetime.timedelta(days=30)


def _new_ca(common_name: str, now: datetime.datetime, expires: datetime.datetime):
    ca_key = _key()
    ca_name = _name(common_name)
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(expires)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca


def _signer(ca_key, ca, now: datetime.datetime, expires: datetime.datetime):
    def leaf(subject: x509.Name, usage, sans=None):
        key = _key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(expires)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, builder.sign(ca_key, hashes.SHA256())

    return leaf


@dataclasses.dataclass(frozen=True, slots=True)
class NatsTls:
    """A CA of its own and nats-server's serving certificate for loopback: clients verify the
    server with `ca_cert` (`--nats-ca`)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def create_nats_tls(directory: Path, *, dns_names: tuple[str, ...] = ("localhost",), loopback: bool = True,
                    days: int = 30, file_names: tuple[str, str, str] = ("nats-ca.crt", "nats-server.crt", "nats-server.key"),
                    ) -> NatsTls:
    """`dns_names` (wildcards such as `*.draplane-nats-headless` allowed) and 127.0.0.1 when
    `loopback` go into the server certificate; `file_names` are those of the CA certificate, the
    server certificate and its key (a Kubernetes TLS Secret wants ca.crt, tls.crt, tls.key)."""
    directory.mkdir(parents=True, exist_ok=True)
    now, _ = _validity()
    expires = now + datetime.timedelta(days=days)
    ca_key, ca = _new_ca("draplane-nats-ca", now, expires)
    sans: list[x509.GeneralName] = [x509.DNSName(name) for name in dns_names]
    if loopback:
        sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    server_key, server = _signer(ca_key, ca, now, expires)(_name("nats-server"), ExtendedKeyUsageOID.SERVER_AUTH, sans)
    tls = NatsTls(*(directory / name for name in file_names))
    tls.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    tls.server_cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    _write_key(tls.server_key, server_key)
    return tls


def create(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    now, expires = _validity()
    ca_key, ca = _new_ca("draplane-local-ca", now, expires)
    leaf = _signer(ca_key, ca, now, expires)

    serving_key, serving = leaf(
        _name("kube-apiserver"),
        ExtendedKeyUsageOID.SERVER_AUTH,
        [
            x509.DNSName("localhost"),
            x509.DNSName("kubernetes"),
            x509.DNSName("kubernetes.default.svc"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
        ],
    )
    # O=system:masters makes this client a cluster admin without any RBAC object.
    admin_key, admin = leaf(_name("draplane-admin", "system:masters"), ExtendedKeyUsageOID.CLIENT_AUTH)
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    pki = Pki(
        ca_cert=directory / "ca.crt",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        service_account_key=directory / "sa.key",
        service_account_pub=directory / "sa.pub",
        admin_token=directory / "admin.token",
        token_file=directory / "tokens.csv",
    )
    pki.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.serving_cert.write_bytes(serving.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.serving_key, serving_key)
    pki.admin_cert.write_bytes(admin.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.admin_key, admin_key)
    _write_key(pki.service_account_key, sa_key)
    pki.service_account_pub.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    token = secrets.token_urlsafe(32)
    pki.admin_token.write_text(token)
    pki.admin_token.chmod(0o600)
    # token,user,uid,"groups": the same identity as the admin certificate
    pki.token_file.write_text(f'{token},draplane-admin,draplane-admin,"system:masters"\n')
    pki.token_file.chmod(0o600)
    return pki
