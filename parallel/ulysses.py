"""The Ulysses all-to-all (DeepSpeed-Ulysses; yunchang's ``all_to_all_4D`` layout), plain torch.distributed.

Sequence-parallel ranks each hold a contiguous shard ``[B, S/N, H, D]`` of a sequence zero-padded to a multiple of
``N`` (Raylight pads the packed H3 sequence so, with no mask). :func:`seq_to_head` gathers the sequence and
scatters the heads: every rank then holds the whole (padded) sequence for ``H/N`` heads, rank ``r`` heads
``[r·H/N, (r+1)·H/N)``, which is the form an attention kernel needs; :func:`head_to_seq` is its inverse.
Both are pure data movement (bit-exact). The heads must divide the group size: the refusal names both.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import DitKitError


def padded_len(seq_len: int, world: int) -> int:
    """The length Raylight pads a sequence of ``seq_len`` tokens to on ``world`` ranks (a multiple of ``world``)."""
    if seq_len < 0 or world < 1:
        raise DitKitError(f"sequence length must be >= 0 and ranks >= 1 (got {seq_len}, {world})")
    return -(-seq_len // world) * world


def valid_rows(seq_len: int, rank: int, world: int) -> int:
    """How many rows of rank ``rank``'s shard are real tokens (the rest are Raylight's zero padding)."""
    shard = padded_len(seq_len, world) // world
    return max(0, min(shard, seq_len - rank * shard))


def _group_size(group) -> int:
    return dist.get_world_size(group)


def seq_to_head(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[B, S/N, H, D]`` sequence shard -> ``[B, S, H/N, D]`` head shard (S the padded length)."""
    n = _group_size(group)
    if x.dim() != 4:
        raise DitKitError(f"seq_to_head expects [B, S/N, H, D], got {tuple(x.shape)}")
    b, s, h, d = x.shape
    if h % n:
        raise DitKitError(f"{h} attention heads cannot be split over {n} sequence-parallel ranks (Ulysses needs the "
                          "head count to be a multiple of the ranks)")
    if n == 1:
        return x
    # [B, s, N, H/N, D] -> [N, s, B, H/N, D]: chunk j (heads of rank j) goes to rank j
    send = x.reshape(b, s, n, h // n, d).permute(2, 1, 0, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] = rank j's sequence shard of my heads -> [N*s, B, H/N, D] -> [B, S, H/N, D]
    return recv.reshape(n * s, b, h // n, d).transpose(0, 1).contiguous()


def head_to_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[B, S, H/N, D]`` head shard -> ``[B, S/N, H, D]`` sequence shard (inverse of :func:`seq_to_head`)."""
    n = _group_size(group)
    if x.dim() != 4:
        raise DitKitError(f"head_to_seq expects [B, S, H/N, D], got {tuple(x.shape)}")
    b, s_full, hn, d = x.shape
    if s_full % n:
        raise DitKitError(f"sequence length {s_full} is not a multiple of the {n} sequence-parallel ranks; pad it to "
                          f"{padded_len(s_full, n)}")
    if n == 1:
        return x
    s = s_full // n
    # [B, N, s, H/N, D] -> [N, s, B, H/N, D]: sequence chunk j goes to rank j
    send = x.reshape(b, n, s, hn, d).permute(1, 2, 0, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] = my sequence chunk of rank j's heads -> [s, B, N, H/N, D] -> [B, s, H, D]
    return recv.permute(2, 1, 0, 3, 4).reshape(b, s, n * hn, d).contiguous()
