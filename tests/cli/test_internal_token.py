"""`cleave internal-token PATH`: the compose stack's shared token, written once and kept."""

from __future__ import annotations

import stat

from cleave.cli.internal_token import write_token
from cleave.cli.main import main


def test_a_new_token_is_random_private_and_kept_across_restarts(tmp_path):
    path = tmp_path / "secrets" / "internal-token"
    assert write_token(path, None) == "new"
    first = path.read_text()
    assert len(first) >= 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert write_token(path, None) == "kept" and path.read_text() == first
    other = tmp_path / "other"
    write_token(other, None)
    assert other.read_text() != first


def test_an_operators_token_wins_over_the_file(tmp_path, monkeypatch, capsys):
    path = tmp_path / "internal-token"
    write_token(path, None)
    monkeypatch.setenv("CLEAVE_INTERNAL_TOKEN", "operator-secret")
    assert main(["internal-token", str(path)]) == 0
    assert path.read_text() == "operator-secret" and "(given)" in capsys.readouterr().err
    monkeypatch.setenv("CLEAVE_INTERNAL_TOKEN", "")  # compose passes an unset variable as empty
    assert main(["internal-token", str(path)]) == 0
    assert path.read_text() == "operator-secret"  # kept, not replaced by a new one
