"""cleave.kv: paged KV cache bookkeeping (block pool, prefix hashes, block tables, copy-on-write)."""

from cleave.kv.block_pool import NULL_BLOCK_ID, BlockPool, OutOfBlocksError
from cleave.kv.manager import ComputedBlocks, KVCacheManager
from cleave.kv.prefix_hash import BlockHash, block_hashes, hash_block, kv_namespace, salt_root

__all__ = [
    "NULL_BLOCK_ID",
    "BlockHash",
    "BlockPool",
    "ComputedBlocks",
    "KVCacheManager",
    "OutOfBlocksError",
    "block_hashes",
    "hash_block",
    "kv_namespace",
    "salt_root",
]
