"""The certificates and kubeconfigs of the lab's Kubernetes control plane (`fleetheal.lab.controlplane`):
a CA, the server and client certificates (`cryptography`), the service-account signing key, and
kubeconfigs that trust that CA.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Mapping
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: The Services' cluster IP range; the API server's certificate names its first address.
SERVICE_CIDR = "10.96.0.0/24"


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class Pki:
    """A throw-away CA for one control plane, and the leaf certificates it signs (ECDSA P-256)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        self.ca = (
            x509.CertificateBuilder()
            .subject_name(_name("fleetheal-lab-ca"))
            .issuer_name(_name("fleetheal-lab-ca"))
            .public_key(self.ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
            .sign(self.ca_key, hashes.SHA256())
        )
        self._write("ca.crt", self.ca.public_bytes(serialization.Encoding.PEM))

    def _write(self, name: str, data: bytes) -> Path:
        path = self.out / name
        path.write_bytes(data)
        path.chmod(0o600)
        return path

    def issue(self, name: str, cn: str, *, org: str | None = None, server: bool = False, client: bool = False) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        usages = [
            u for u, on in ((ExtendedKeyUsageOID.SERVER_AUTH, server), (ExtendedKeyUsageOID.CLIENT_AUTH, client)) if on
        ]
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn, org))
            .issuer_name(self.ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if server:
            service_ip = ipaddress.IPv4Network(SERVICE_CIDR)[1]
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.DNSName("kubernetes"),
                        x509.DNSName("kubernetes.default"),
                        x509.DNSName("kubernetes.default.svc"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        x509.IPAddress(service_ip),
                    ]
                ),
                critical=False,
            )
        cert = builder.sign(self.ca_key, hashes.SHA256())
        self._write(f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM))
        self._write(f"{name}.key", _pem_key(key))

    def service_account_key(self) -> None:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self._write("sa.key", _pem_key(key))
        self._write(
            "sa.pub",
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
        )


def cert_kubeconfig(path: Path, server: str, pki: Path, cert: str, user: str) -> Path:
    """A kubeconfig for `user` with the client certificate `cert` (under `pki`)."""
    key = {"client-certificate": str(pki / f"{cert}.crt"), "client-key": str(pki / f"{cert}.key")}
    return write_kubeconfig(path, server, pki / "ca.crt", user, key)


def write_kubeconfig(path: Path, server: str, ca_file: Path, user: str, credentials: Mapping[str, str]) -> Path:
    """A kubeconfig (mode 0600) for `server`, trusting `ca_file`, as `user` with `credentials` (a client
    certificate and key, or a bearer `token`)."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fleetheal-lab", "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": user, "user": dict(credentials)}],
        "contexts": [{"name": "fleetheal-lab", "context": {"cluster": "fleetheal-lab", "user": user}}],
        "current-context": "fleetheal-lab",
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    path.chmod(0o600)
    return path
