"""The paged KV cache tensors (the block manager that hands out blocks lives in the engine).

Layout: ``k`` and ``v`` are ``[n_layers, num_blocks, block_size, n_kv_heads, head_dim]``;
token slot ``s`` of layer ``l`` is ``k[l].view(-1, Hk, D)[s]``, i.e. block ``s // block_size``,
offset ``s % block_size``. Slots that no sequence has written hold garbage: every reader
masks by the context length (and the kernels read masked slots as zeros).
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class KVCache:
    k: torch.Tensor  # [n_layers, num_blocks, block_size, Hk, D]
    v: torch.Tensor  # [n_layers, num_blocks, block_size, Hk, D]

    def __post_init__(self):
        for name in ("k", "v"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 5:
                raise ValueError(
                    f"{name} must be [n_layers, num_blocks, block_size, Hk, D], got shape {tuple(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
        if self.k.shape != self.v.shape or self.k.dtype != self.v.dtype or self.k.device != self.v.device:
            raise ValueError(
                f"k and v must match: {tuple(self.k.shape)} {self.k.dtype} {self.k.device} vs "
                f"{tuple(self.v.shape)} {self.v.dtype} {self.v.device}")

    @classmethod
    def allocate(cls, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device="cuda", zero: bool = False) -> "KVCache":
        """Allocate k and v (uninitialised unless ``zero``: readers must mask unwritten slots)."""
        for name, value in (("n_layers", n_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                            ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
        make = torch.zeros if zero else torch.empty
        return cls(make(shape, dtype=dtype, device=device), make(shape, dtype=dtype, device=device))

    @staticmethod
    def bytes_per_block(n_layers: int, block_size: int, n_kv_heads: int, head_dim: int,
                        dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes one block takes over all layers, k and v together (for sizing the cache)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * n_layers * block_size * n_kv_heads * head_dim * itemsize

    @property
    def n_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_slots(self) -> int:
        return self.k.shape[1] * self.k.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of one layer, each ``[num_blocks, block_size, Hk, D]`` (views, no copy)."""
        return self.k[index], self.v[index]
