"""``cpu_batched``: exact block-sparse attention for CPU built from few large fused-attention calls.

Same contract as :func:`.block_sparse.block_sparse_attn_reference` (tile-ordered ``[B, H, S, D]``, 64-row tiles,
ragged key tiles masked, ``(out, lse_log2)``). Per (b, h) it splits the selection into three exact parts:

* **dense query tiles** (every key tile selected, e.g. H3 prefix rows): ONE attention call of all those query
  rows over the live keys (pad key rows dropped once, so no mask);
* **common key tiles** of the remaining query tiles (tiles every one of them selects, e.g. H3 prefix keys that
  every video query sees): ONE attention call of all remaining query rows over those live keys;
* **the rest** (per-query-tile key tiles, e.g. the top-k video tiles): K/V tiles gathered into reused
  ``[n, count*64, D]`` buffers, one batched attention call per chunk (ragged tiles via an additive mask);

and merges the common and rest parts per row with their log-sum-exps (``m = logaddexp(m_c, m_r)``,
``o = o_c e^(m_c-m) + o_r e^(m_r-m)``, in fp32), which is the softmax over the union exactly. The attention
calls are ATen's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``), which returns the
log-sum-exp the merge needs. CPU only; picked by ``auto`` on CPU.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .block_sparse import LOG2E, OP, TILE, _allowed_tiles
from .registry import REGISTRY, Impl, Query

NAME = "cpu_batched"


def _flash_op():
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    except (AttributeError, RuntimeError):
        return None


_FLASH = _flash_op()


def _take(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[rows]`` for ascending ``rows`` (from nonzero): a view for a contiguous range, else a gather."""
    view = _view(x, rows)
    return view if view is not None else x[rows]


def _live_rows(tiles: torch.Tensor, key_live: torch.Tensor) -> Optional[torch.Tensor]:
    """Flat key positions of the live rows of ``tiles`` (None when they are all whole and contiguous)."""
    pos = (tiles[:, None] * TILE + torch.arange(TILE, device=tiles.device)[None, :])
    live = key_live[tiles]
    if bool(live.all()) and int(tiles[-1]) - int(tiles[0]) == tiles.numel() - 1:
        return None
    return pos[live]


def _keys(kbh: torch.Tensor, vbh: torch.Tensor, tiles: torch.Tensor, key_live: torch.Tensor):
    pos = _live_rows(tiles, key_live)
    if pos is None:
        a, b = int(tiles[0]) * TILE, (int(tiles[-1]) + 1) * TILE
        return kbh[a:b], vbh[a:b]
    return kbh.index_select(0, pos), vbh.index_select(0, pos)


def block_sparse_attn_cpu(q, k, v, q2k_index, q2k_num, variable_block_sizes, need_lse: bool = True,
                          max_chunk_elems: Optional[int] = None, rest_kernel: Optional[Callable] = None):
    """``rest_kernel(q_tiles, k_tiles, v_tiles, sel, cnt, live, scale) -> (out, lse)`` replaces the gathered
    per-query-tile part when given (``cpu_native``: one fused C++ pass per query tile); fp32 only."""
    B, H, S, D = q.shape
    T, Tk = S // TILE, k.shape[2] // TILE
    if max_chunk_elems is None:
        # ~2 MiB fp32 K gather per chunk and thread: small enough to stay in cache, enough query tiles per call
        # (the CPU flash kernel splits work by query block) to keep every thread busy
        max_chunk_elems = (1 << 19) * max(1, torch.get_num_threads())
    scale = D ** -0.5
    dev = q.device
    q, k, v = (x.contiguous() for x in (q, k, v))
    allowed = _allowed_tiles(q2k_index.to(dev), q2k_num.to(dev), Tk)             # [B,H,T,Tk] bool
    vbs = variable_block_sizes.to(device=dev, dtype=torch.long)
    key_live = torch.arange(TILE, device=dev)[None, :] < vbs[:, None]          # [Tk, 64]
    ragged_tile = ~key_live.all(dim=-1)                                          # [Tk]
    out = torch.empty_like(q)                 # every tile row is written below (empty query tiles: zeros)
    lse = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=dev)
    ot = out.view(B, H, T, TILE, D)
    lt = lse.view(B, H, T, TILE)
    all_tiles = torch.arange(Tk, device=dev)
    neg_inf = float("-inf")

    def flash(qq, kk, vv, mask=None):
        """qq [N, M, D], kk/vv [N, L, D] -> (out [N, M, D], natural lse [N, M] fp32)."""
        o, m = _FLASH(qq[:, None], kk[:, None], vv[:, None], attn_mask=mask, scale=scale)
        return o[:, 0], m[:, 0].float()

    for b in range(B):
        for h in range(H):
            A = allowed[b, h]
            cnt = A.sum(dim=-1)
            empty = torch.nonzero(cnt == 0).view(-1)
            if empty.numel():
                ot[b, h, empty] = 0
            qbh = q[b, h].view(T, TILE, D)
            kbh, vbh = k[b, h], v[b, h]
            dense = cnt == Tk
            if bool(dense.any()):
                rows = torch.nonzero(dense).view(-1)
                kc, vc = _keys(kbh, vbh, all_tiles, key_live)
                o, m = flash(_take(qbh, rows).reshape(1, -1, D), kc[None], vc[None])
                ot[b, h, rows] = o.view(-1, TILE, D)
                lt[b, h, rows] = m.view(-1, TILE)
            rest = (cnt > 0) & ~dense
            if not bool(rest.any()):
                continue
            rows = torch.nonzero(rest).view(-1)
            n = rows.numel()
            qr = _take(qbh, rows)                                                  # [n, 64, D]
            Ar = A[rows]
            common = Ar.all(dim=0)
            oc = mc = None
            if bool(common.any()):
                kc, vc = _keys(kbh, vbh, torch.nonzero(common).view(-1), key_live)
                oc, mc = flash(qr.reshape(1, -1, D), kc[None], vc[None])
                oc, mc = oc.view(n, TILE, D), mc.view(n, TILE)
            R = Ar & ~common
            rc = R.sum(dim=-1)
            if oc is None or bool(rc.any()):
                o_r = q.new_zeros(n, TILE, D)
                m_r = torch.full((n, TILE), neg_inf, dtype=torch.float32, device=dev)
                # ascending selected tiles first: sort key = tile id if selected else Tk + tile id
                order = torch.where(R, all_tiles, all_tiles + Tk).sort(dim=-1).values
                kf = kbh.view(Tk, TILE * D)
                vf = vbh.view(Tk, TILE * D)
                counts = torch.unique(rc).tolist()
                if rest_kernel is not None:
                    counts = []                        # one native call for every rest query tile
                    o_r, m_r = rest_kernel(qr.contiguous(), kbh.view(Tk, TILE, D), vbh.view(Tk, TILE, D),
                                           order[:, :max(1, int(rc.max()))].contiguous(), rc.long(), vbs, scale)
                for count in counts:
                    if count <= 0:
                        continue
                    sel = torch.nonzero(rc == count).view(-1)
                    tiles_all = order[sel, :count]                                  # [ns, count]
                    step = max(1, min(sel.numel(), max_chunk_elems // (count * TILE * D)))
                    kbuf = k.new_empty(step * count, TILE * D)
                    vbuf = v.new_empty(step * count, TILE * D)
                    whole = sel.numel() == n
                    any_ragged = bool(ragged_tile[tiles_all].any())
                    for s0 in range(0, sel.numel(), step):
                        tl_ = tiles_all[s0:s0 + step]
                        flat = tl_.reshape(-1)
                        nf = flat.numel()
                        kk = torch.index_select(kf, 0, flat, out=kbuf[:nf]).view(-1, count * TILE, D)
                        vv = torch.index_select(vf, 0, flat, out=vbuf[:nf]).view(-1, count * TILE, D)
                        mask = None
                        if any_ragged and bool(ragged_tile[flat].any()):
                            live = key_live[tl_].reshape(-1, 1, 1, count * TILE)
                            mask = torch.zeros(live.shape, dtype=q.dtype, device=dev).masked_fill_(~live, neg_inf)
                        if whole:
                            qq = qr[s0:s0 + step]
                            o, m = flash(qq, kk, vv, mask)
                            o_r[s0:s0 + step] = o
                            m_r[s0:s0 + step] = m
                        else:
                            si = sel[s0:s0 + step]
                            o, m = flash(qr[si], kk, vv, mask)
                            o_r[si] = o
                            m_r[si] = m
                if oc is None:
                    oc, mc = o_r, m_r
                else:
                    m = torch.logaddexp(mc, m_r)
                    wc = torch.exp(mc - m)[..., None]
                    wr = torch.exp(m_r - m)[..., None]
                    dst = _view(ot[b, h], rows)
                    if oc.dtype == torch.float32 and dst is not None:
                        torch.mul(oc, wc, out=dst)                  # merge straight into the output rows
                        dst.add_(o_r.mul_(wr))
                        _put(lt[b, h], rows, m)
                        continue
                    oc = (oc.float() * wc + o_r.float() * wr).to(q.dtype)
                    mc = m
            _put(ot[b, h], rows, oc)
            _put(lt[b, h], rows, mc)
    if need_lse:
        lse.mul_(LOG2E)
        return out, lse
    return out, None


def _view(x: torch.Tensor, rows: torch.Tensor) -> Optional[torch.Tensor]:
    """``x[rows]`` as a view when ``rows`` (ascending) is a contiguous range, else None."""
    n = rows.numel()
    if n and int(rows[-1]) - int(rows[0]) == n - 1:
        return x[int(rows[0]):int(rows[0]) + n]
    return None


def _put(dst: torch.Tensor, rows: torch.Tensor, val: torch.Tensor) -> None:
    view = _view(dst, rows)
    if view is not None:
        view.copy_(val)
    else:
        dst[rows] = val


def _cpu_check(q: Query, explicit: bool) -> Optional[str]:
    if q.device_type != "cpu":
        return f"CPU only (got {q.device_type})"
    if _FLASH is None:
        return "this torch has no aten._scaled_dot_product_flash_attention_for_cpu"
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} not supported"
    return None


REGISTRY.impl(OP, Impl(NAME, block_sparse_attn_cpu, _cpu_check, priority=40,
                       note="CPU: dense rows / common key tiles / gathered rest as few flash calls, LSE merge"))
