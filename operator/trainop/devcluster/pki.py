"""Certificates for the local control plane: one CA, the API server's serving certificate, an
admin client certificate (group system:masters) and the service-account signing key.

Written with `cryptography` (already a dependency through azure-identity) rather than shelling
out to openssl, so `devcluster up` needs nothing else installed.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

VALIDITY = datetime.timedelta(days=365)


def _key_pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(subject, issuer, public_key, signing_key, *, ca=False, sans=(), usage=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def write_client_cert(folder: Path, name: str, cn: str, org: str | None = None) -> None:
    """<name>.crt/.key: a client certificate signed by the cluster CA (a kubelet's node identity:
    CN system:node:<node>, O system:nodes, which the Node authorizer recognises)."""
    ca = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _cert(_name(cn, org), ca.subject, key.public_key(), ca_key,
                 usage=x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH)
    (folder / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / f"{name}.key").write_bytes(_key_pem(key))
    (folder / f"{name}.key").chmod(0o600)


def write_pki(folder: Path, service_ip: str, extra_ips: tuple[str, ...] = ()) -> None:
    """Create ca.crt, apiserver.{crt,key}, admin.{crt,key}, sa.{key,pub} in folder (once);
    extra_ips: further addresses the API server is reached at (the real nodes' host address)."""
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "sa.pub").exists():
        return
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("trainop-devcluster-ca")
    ca = _cert(ca_name, ca_name, ca_key.public_key(), ca_key, ca=True)

    server_key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(n) for n in ("localhost", "kubernetes", "kubernetes.default",
                                       "kubernetes.default.svc", "kubernetes.default.svc.cluster.local")]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", service_ip, *extra_ips)]
    server = _cert(_name("kube-apiserver"), ca_name, server_key.public_key(), ca_key,
                   sans=sans, usage=x509.oid.ExtendedKeyUsageOID.SERVER_AUTH)

    admin_key = ec.generate_private_key(ec.SECP256R1())
    admin = _cert(_name("trainop-admin", "system:masters"), ca_name, admin_key.public_key(), ca_key,
                  usage=x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH)

    # Service-account tokens are signed with RSA, which every client library verifies.
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    pem = serialization.Encoding.PEM
    files = {
        "ca.crt": ca.public_bytes(pem),
        "ca.key": _key_pem(ca_key),
        "apiserver.crt": server.public_bytes(pem),
        "apiserver.key": _key_pem(server_key),
        "admin.crt": admin.public_bytes(pem),
        "admin.key": _key_pem(admin_key),
        "sa.key": _key_pem(sa_key),
        "sa.pub": sa_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo),
    }
    for name, data in files.items():
        path = folder / name
        path.write_bytes(data)
        if name.endswith(".key"):
            path.chmod(0o600)
