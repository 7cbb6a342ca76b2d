"""The committed stubs match protos/, and the protos follow the API conventions."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "protos" / "cleave" / "v1"
FIELD_RE = re.compile(r"^\s*(optional |repeated )?[\w.]+(<[\w, ]+>)? \w+ = \d+;")


@pytest.fixture(scope="module")
def gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", REPO_ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_fresh(gen_protos):
    assert gen_protos.stale_files(gen_protos.PROTO_ROOT, gen_protos.OUTPUT_ROOT) == []


def test_check_fails_when_a_proto_changes(gen_protos, tmp_path, capsys):
    proto_root, output_root = tmp_path / "protos", tmp_path / "proto_out"
    shutil.copytree(REPO_ROOT / "protos", proto_root)
    shutil.copytree(gen_protos.OUTPUT_ROOT, output_root)
    argv = ["--check", "--proto-root", str(proto_root), "--output-root", str(output_root)]
    assert gen_protos.main(argv) == 0

    common = proto_root / "cleave" / "v1" / "common.proto"
    common.write_text(common.read_text().replace("  uint32 min_tokens = 16;\n",
                                                 "  uint32 min_tokens = 16;\n  bool echo = 99;\n"))
    assert gen_protos.main(argv) == 1
    err = capsys.readouterr().err
    assert "common_pb2.py" in err and "common_pb2.pyi" in err
    assert "gateway_pb2.py" not in err  # only the changed file's stubs are stale


def test_stubs_import_from_the_cleave_package():
    from cleave.proto.cleave.v1 import common_pb2, decode_pb2_grpc, gateway_pb2

    request = gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(n=2))
    assert gateway_pb2.GenerateRequest.FromString(request.SerializeToString()).sampling.n == 2
    assert hasattr(decode_pb2_grpc, "DecodeStub")


def test_every_enum_starts_with_unspecified():
    from cleave.proto.cleave.v1 import common_pb2, decode_pb2, gateway_pb2, kvstore_pb2, prefill_pb2

    enums = []
    for module in (common_pb2, decode_pb2, gateway_pb2, kvstore_pb2, prefill_pb2):
        enums += list(module.DESCRIPTOR.enum_types_by_name.values())
        for message in module.DESCRIPTOR.message_types_by_name.values():
            enums += list(message.enum_types)
    assert len(enums) >= 7
    for enum in enums:
        zero = enum.values_by_number[0].name
        assert zero.endswith("UNSPECIFIED"), f"{enum.full_name}: value 0 is {zero}"


@pytest.mark.parametrize("proto", sorted(p.name for p in PROTO_DIR.glob("*.proto")))
def test_every_field_is_documented(proto):
    lines = (PROTO_DIR / proto).read_text().splitlines()
    undocumented = []
    for number, line in enumerate(lines):
        if FIELD_RE.match(line) and not lines[number - 1].strip().startswith("//"):
            undocumented.append(f"{proto}:{number + 1}: {line.strip()}")
    assert undocumented == []
