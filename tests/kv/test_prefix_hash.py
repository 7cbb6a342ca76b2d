import hashlib
import struct

import pytest

from cleave.kv.prefix_hash import block_hashes, hash_block, kv_namespace, salt_root

GOLDEN_ROOT_1234 = "db6dca7e61fe821c975eb657adac6394e7767bb8b7bb81a42c248a2e89d9ff7b"


def _spec_hash(parent, tokens, namespace=b""):
    """The documented encoding, written out independently of the implementation."""
    data = b"cleave.kv.block/v1" + struct.pack("<I", len(namespace)) + namespace
    data += b"\x00" if parent is None else b"\x01" + parent
    data += struct.pack("<I", len(tokens)) + b"".join(struct.pack("<I", t) for t in tokens)
    return hashlib.sha256(data).digest()


def test_golden_value_is_stable():
    assert hash_block(None, [1, 2, 3, 4]).hex() == GOLDEN_ROOT_1234


def test_matches_documented_encoding_with_parent_and_namespace():
    namespace = kv_namespace("llama-3-8b@abc", "bfloat16", 16)
    root = hash_block(None, [7, 8], namespace)
    assert root == _spec_hash(None, [7, 8], namespace)
    assert hash_block(root, [2**32 - 1, 0], namespace) == _spec_hash(root, [2**32 - 1, 0], namespace)


def test_block_hashes_chain_full_blocks_only():
    tokens = list(range(10))
    hashes = block_hashes(tokens, 4)
    assert len(hashes) == 2  # tokens 8, 9 form a partial block
    assert hashes[0] == hash_block(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    # Same block content under a different prefix hashes differently.
    assert block_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != hashes[1]
    # Continuing a chain from a parent equals hashing the whole sequence.
    assert block_hashes(tokens[4:], 4, parent=hashes[0]) == hashes[1:]


def test_namespace_separates_models():
    a = block_hashes([1, 2, 3, 4], 4, kv_namespace("model-a", "bfloat16", 4))
    b = block_hashes([1, 2, 3, 4], 4, kv_namespace("model-b", "bfloat16", 4))
    assert a != b


def test_namespace_is_canonical():
    assert kv_namespace("m", "float16", 16, extra={"tp": "2"}) == (
        b"block_size=16\ndtype=float16\nlayout=layers,kv,blocks,block_size,kv_heads,head_dim\nmodel=m\ntp=2"
    )
    with pytest.raises(ValueError):
        kv_namespace("m", "float16", 16, extra={"model": "x"})


def test_rejects_bad_tokens_and_parents():
    with pytest.raises(ValueError):
        hash_block(None, [-1])
    with pytest.raises(ValueError):
        hash_block(b"short", [1])


def test_a_salted_chain_starts_at_the_documented_salt_root():
    root = hashlib.sha256(b"cleave.kv.salt/v1" + "tenant-é".encode("utf-8")).digest()
    assert salt_root("tenant-é") == root and salt_root("") is None
    namespace = kv_namespace("m", "bfloat16", 2)
    salted = block_hashes([5, 6, 7, 8], 2, namespace, parent=root)
    assert salted[0] == _spec_hash(root, [5, 6], namespace)
    assert salted[1] == _spec_hash(salted[0], [7, 8], namespace)


def test_salts_separate_chains_that_one_salt_shares():
    tokens = [1, 2, 3, 4, 5, 6]
    unsalted = block_hashes(tokens, 2)
    by_salt = {salt: block_hashes(tokens, 2, parent=salt_root(salt)) for salt in ("a", "b")}
    assert by_salt["a"] == block_hashes(tokens, 2, parent=salt_root("a"))
    everything = unsalted + by_salt["a"] + by_salt["b"]
    assert len(set(everything)) == len(everything)  # no block of one chain names a block of another
