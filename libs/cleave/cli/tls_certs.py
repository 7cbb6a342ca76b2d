"""`cleave tls-certs DIR`: a certificate authority and one certificate for a stack's services,
so every service can serve TLS and check its peers (`--tls-cert-file DIR/cert.pem --tls-key-file
DIR/key.pem --tls-ca-file DIR/ca.pem`; `cleave.tls`).

DIR gets `ca.pem` (give it to clients, which check the gateway against it), `cert.pem` and
`key.pem` (readable by their owner only). The certificate names localhost, 127.0.0.1, ::1, this
host's name and every `--host` (the names services dial each other by: compose service names, a
host's DNS name or IP). The CA's key is not kept: nothing can sign another certificate for the
stack later, so a new host means a new DIR. An existing DIR is kept as it is (restarts keep
their certificates) unless `--force`.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import socket
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cleave.cli._private_file import write_private
from cleave.tls import TlsConfig

if TYPE_CHECKING:
    from cryptography import x509

CA_FILE, CERT_FILE, KEY_FILE = "ca.pem", "cert.pem", "key.pem"
DEFAULT_DAYS = 365
BASE_NAMES = ("localhost", "127.0.0.1", "::1")


def stack_files(directory: Path) -> TlsConfig:
    """The TLS configuration of the files `write_certificates` puts under `directory`."""
    return TlsConfig(directory / CERT_FILE, directory / KEY_FILE, directory / CA_FILE)


def _alt_name(name: str) -> x509.GeneralName:
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _names(hosts: Iterable[str]) -> list[str]:
    names: list[str] = []
    for name in (*BASE_NAMES, socket.gethostname(), *hosts):
        name = name.strip()
        if name and name not in names:
            names.append(name)
    return names


def write_certificates(directory: Path, hosts: Sequence[str] = (), days: int = DEFAULT_DAYS) -> TlsConfig:
    """Write a fresh CA and a certificate it signed for `hosts` (and the base names) into
    `directory`, replacing what is there; returns the files as a process's TLS configuration."""
    # imported here: a stack without TLS (and the GPU images) need not have the package
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    files = stack_files(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cleave stack CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))

    key = ec.generate_private_key(ec.SECP256R1())
    names = _names(hosts)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cleave service")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([_alt_name(name) for name in names]), critical=False)
            # one certificate serves a service's server and its calls to the others
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))

    write_private(files.key_file, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    files.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))  # written last: marks the set complete
    return files


def run(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    files = stack_files(directory)
    if all(path.is_file() for path in (files.cert_file, files.key_file, files.ca_file)) and not args.force:
        print(f"TLS certificates at {directory} (kept)", file=sys.stderr)
        return 0
    write_certificates(directory, args.host, args.days)
    print(f"TLS certificates at {directory} (new; names: {', '.join(_names(args.host))})", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tls-certs", help="write a CA and a certificate for a stack's services (TLS between them)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="where ca.pem, cert.pem and key.pem go")
    parser.add_argument("--host", action="append", default=[],
                        help="a name or IP address services are dialled by (repeatable)")
    parser.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity of both certificates")
    parser.add_argument("--force", action="store_true", help="replace certificates already in the directory")
    parser.set_defaults(handler=run)
