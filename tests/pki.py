"""A test PKI made with the ``openssl`` command, as an operator would: a CA, a server certificate for loopback,
client certificates for nodes, and a stranger (a certificate from another CA)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(folder: Path, name: str) -> None:
    _openssl("req", "-x509", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj",
             f"/CN={name}", cwd=folder)


def _signed(folder: Path, name: str, ca: str, extensions: str) -> None:
    _openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=folder)
    (folder / f"{name}.ext").write_text(extensions)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=folder)


@dataclass(frozen=True)
class Pki:
    """The files of :func:`make_pki`: ``<name>.pem`` (certificate) and ``<name>.key`` (private key)."""

    folder: Path

    def cert(self, name: str) -> str:
        """Path of ``name``'s certificate."""
        return str(self.folder / f"{name}.pem")

    def key(self, name: str) -> str:
        """Path of ``name``'s private key."""
        return str(self.folder / f"{name}.key")


def make_pki(folder: Path, nodes: int = 2) -> Pki:
    """CA ``ca``; ``server`` for 127.0.0.1/localhost; ``node-0`` .. ``node-{nodes-1}`` (client auth), signed by
    ``ca``; ``stranger`` (client auth) signed by another CA, ``other-ca``."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    folder.mkdir(parents=True, exist_ok=True)
    _ca(folder, "ca")
    _ca(folder, "other-ca")
    _signed(folder, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    for i in range(nodes):
        _signed(folder, f"node-{i}", "ca", "extendedKeyUsage=clientAuth\n")
    _signed(folder, "stranger", "other-ca", "extendedKeyUsage=clientAuth\n")
    return Pki(folder)
