"""Target KV tensors laid out by block id, pool sizing from a memory budget, slot arithmetic.

Slot of position p in a sequence = block_table[p // page] * page + p % page; one flat
[num_blocks * page, h_kv, d] tensor per layer for K and for V.
"""

from __future__ import annotations

import torch

from dspark_sglang.config import ArchConfig, CacheConfig, ConfigError

_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def bytes_per_block(arch: ArchConfig, page_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim
    return per_token * page_size * _DTYPE_BYTES[dtype]


def num_blocks_for(
    arch: ArchConfig, cache: CacheConfig, dtype: torch.dtype, extra_per_block: int = 0
) -> int:
    """Blocks that fit the budget; `extra_per_block` is the drafter's context K/V per block."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = bytes_per_block(arch, cache.page_size, dtype) + extra_per_block
    n = cache.kv_cache_bytes // per_block
    if n < 1:
        raise ConfigError(
            f"KV budget of {cache.kv_cache_bytes} bytes holds no block: one block of "
            f"{cache.page_size} tokens needs {per_block} bytes; raise --kv-cache-bytes"
        )
    return n


def allocate_kv(
    arch: ArchConfig, num_blocks: int, page_size: int, dtype: torch.dtype, device: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks * page_size, arch.num_key_value_heads, arch.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(arch.num_hidden_layers)
    ]


def slots(block_table: list[int], start: int, end: int, page_size: int) -> list[int]:
    return [block_table[p // page_size] * page_size + p % page_size for p in range(start, end)]
