"""The gang's SSH key pair, generated once per job (the operator stores it in the job's Secret
and never regenerates it; the same key is the workers' sshd host key, so the launcher can pin it
in known_hosts instead of disabling host key checking)."""

from __future__ import annotations

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


def generate() -> tuple[str, str]:
    """(private key in OpenSSH PEM format, public key line 'ssh-ed25519 AAAA... trainop')."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH).decode()
    return private, f"{public} trainop"
