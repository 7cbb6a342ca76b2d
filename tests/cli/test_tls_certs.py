"""`cleave tls-certs DIR`: a CA and a certificate that names the stack's hosts, the key private,
kept across restarts (the handshakes with it: tests/rpc/test_tls.py)."""

from __future__ import annotations

import ipaddress
import ssl
import stat

from cryptography import x509

from cleave.cli.main import main
from cleave.cli.tls_certs import stack_files


def test_the_certificate_names_the_hosts_and_its_key_is_private(tmp_path, capsys):
    directory = tmp_path / "tls"
    assert main(["tls-certs", str(directory), "--host", "decode", "--host", "10.0.0.7", "--days", "2"]) == 0
    files = stack_files(directory)
    assert files.ca_file.is_file() and stat.S_IMODE(files.key_file.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(files.cert_file.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "decode"} <= set(names.get_values_for_type(x509.DNSName))
    assert {ipaddress.ip_address(a) for a in ("127.0.0.1", "::1", "10.0.0.7")} <= set(
        names.get_values_for_type(x509.IPAddress))
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days == 2
    ca = x509.load_pem_x509_certificate(files.ca_file.read_bytes())
    cert.verify_directly_issued_by(ca)  # raises unless the CA signed it
    assert "(new; names: localhost, 127.0.0.1, ::1" in capsys.readouterr().err
    # the key is the certificate's: the pair loads as a server's
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(files.cert_file, files.key_file)


def test_existing_certificates_are_kept_unless_forced(tmp_path, capsys):
    directory = tmp_path / "tls"
    main(["tls-certs", str(directory)])
    files = stack_files(directory)
    first = files.cert_file.read_bytes()
    assert main(["tls-certs", str(directory)]) == 0 and files.cert_file.read_bytes() == first
    assert "(kept)" in capsys.readouterr().err
    assert main(["tls-certs", str(directory), "--force"]) == 0 and files.cert_file.read_bytes() != first
