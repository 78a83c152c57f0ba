"""Causal attention with a fixed key-chunk order as Triton kernels, over a dense sequence or vLLM's paged KV cache.

Same contract as :mod:`shared_numerics.attention`: a query attends to positions ``0..pos`` of its sequence in chunks of
``KEY_CHUNK`` = 32 absolute positions, in increasing order, with the online softmax. One program handles one tile of
up to ``Q_TILE`` = 16 consecutive queries of one sequence (times the ``G`` query heads of one kv head, ``16·G`` rows)
against one kv head; each row's arithmetic involves only that row, so neither the tile's other rows nor the number of
tiles matter. Keys are addressed through a block table in both layouts — the dense ``[B, T, Hkv, D]`` keys are "paged"
with one ``T``-token block per sequence — so the trainer and vLLM run literally the same kernel code per row.

Backward (dense layout, training): FlashAttention-2 style (Dao 2023): ``dQ`` per query tile, ``dK``/``dV`` per
(sequence, 32-key chunk, kv head), both recomputing ``p = exp(s - lse)`` from the forward's saved log-sum-exp.
Against the torch backend: ~1e-6 relative (different dot-product and exp implementations).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention import KEY_CHUNK, Q_TILE
from ._common import next_pow2

__all__ = ["dense_causal_attention", "paged_causal_attention"]


@triton.jit
def _attn_fwd(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, qpos_ptr, tseq_ptr, tq0_ptr, tnq_ptr, bt_ptr,
              sqt, sqh, skb, skh, skt, svb, svh, svt, sbt, block_size, scale, D, G, NHQ,
              TQ: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, C: tl.constexpr):
    tile = tl.program_id(0)
    hk = tl.program_id(1)
    seq = tl.load(tseq_ptr + tile)
    q0 = tl.load(tq0_ptr + tile)
    nq = tl.load(tnq_ptr + tile)
    r = tl.arange(0, BR)
    qi = r // G
    gi = r % G
    rvalid = (qi < nq) & (r < TQ * G)
    pos = tl.load(qpos_ptr + q0 + qi, mask=rvalid, other=-1)
    d = tl.arange(0, BD)
    dmask = d < D
    head = hk * G + gi
    q = tl.load(q_ptr + (q0 + qi)[:, None] * sqt + head[:, None] * sqh + d[None, :],
                mask=rvalid[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    last = tl.max(pos, axis=0)
    m = tl.full((BR,), float("-inf"), tl.float32)
    l = tl.zeros((BR,), dtype=tl.float32)
    acc = tl.zeros((BR, BD), dtype=tl.float32)
    offs = tl.arange(0, C)
    for j in range(0, last // C + 1):
        kpos = j * C + offs
        kin = kpos <= last
        blk = tl.load(bt_ptr + seq * sbt + kpos // block_size, mask=kin, other=0)
        slot = kpos % block_size
        kmask = kin[:, None] & dmask[None, :]
        k = tl.load(k_ptr + blk[:, None] * skb + hk * skh + slot[:, None] * skt + d[None, :], mask=kmask,
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + blk[:, None] * svb + hk * svh + slot[:, None] * svt + d[None, :], mask=kmask,
                    other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    l_safe = tl.where(l > 0, l, 1.0)  # padding rows (no keys) stay finite; they are never stored
    out = acc / l_safe[:, None]
    tl.store(o_ptr + (q0 + qi)[:, None] * sqt + head[:, None] * sqh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=rvalid[:, None] & dmask[None, :])
    tl.store(lse_ptr + (q0 + qi) * NHQ + head, m + tl.log(l_safe), mask=rvalid)


def _tiles(q_lens: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tile: sequence index, first query index, query count (tiles of Q_TILE consecutive queries per sequence)."""
    q_lens = q_lens.long().cpu()
    starts = torch.cumsum(q_lens, 0) - q_lens
    per = (q_lens + Q_TILE - 1) // Q_TILE
    seq = torch.repeat_interleave(torch.arange(q_lens.numel()), per)
    k = torch.arange(int(per.sum())) - torch.repeat_interleave(torch.cumsum(per, 0) - per, per)
    q0 = starts[seq] + k * Q_TILE
    nq = torch.minimum(q_lens[seq] - k * Q_TILE, torch.tensor(Q_TILE))
    return (seq.to(device=device, dtype=torch.int32), q0.to(device=device, dtype=torch.int32),
            nq.to(device=device, dtype=torch.int32))


def _forward(q, k_store, v_store, q_pos, q_lens, block_table, block_size, scale):
    """``q [Nq, Hq, D]`` contiguous; ``k_store``/``v_store`` 4-D ``[blocks, Hkv, slot, D]``-strided views."""
    n_q, h_q, d = q.shape
    h_kv = k_store.shape[1]
    if h_q % h_kv:
        raise ValueError(f"query heads {h_q} not a multiple of kv heads {h_kv}")
    g = h_q // h_kv
    out = torch.empty_like(q)
    lse = torch.empty((n_q, h_q), dtype=torch.float32, device=q.device)
    if n_q == 0:
        return out, lse
    tseq, tq0, tnq = _tiles(q_lens, q.device)
    bt = block_table.to(torch.int32).contiguous()
    grid = (tseq.numel(), h_kv)
    _attn_fwd[grid](q, k_store, v_store, out, lse, q_pos.to(torch.int32).contiguous(), tseq, tq0, tnq, bt,
                    q.stride(0), q.stride(1), k_store.stride(0), k_store.stride(1), k_store.stride(2),
                    v_store.stride(0), v_store.stride(1), v_store.stride(2), bt.stride(0), block_size, scale, d, g, h_q,
                    TQ=Q_TILE, BR=next_pow2(Q_TILE * g), BD=next_pow2(d), C=KEY_CHUNK)
    return out, lse


@triton.jit
def _attn_bwd_dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, T, NHQ, NHK, D, G, scale,
                 BR: tl.constexpr, BD: tl.constexpr, C: tl.constexpr, TQ: tl.constexpr):
    """Dense layout [B, T, H, D] contiguous. Program: (sequence b, query tile i, kv head)."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    hk = tl.program_id(2)
    r = tl.arange(0, BR)
    t = i * TQ + r // G
    head = hk * G + r % G
    rvalid = (t < T) & (r < TQ * G)
    d = tl.arange(0, BD)
    dmask = d < D
    row = (b * T + t) * NHQ + head
    m2 = rvalid[:, None] & dmask[None, :]
    q = tl.load(q_ptr + row[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + row[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row, mask=rvalid, other=0.0)
    delta = tl.load(delta_ptr + row, mask=rvalid, other=0.0)
    pos = tl.where(rvalid, t, -1)
    last = tl.max(pos, axis=0)
    dq = tl.zeros((BR, BD), dtype=tl.float32)
    offs = tl.arange(0, C)
    for j in range(0, last // C + 1):
        kpos = j * C + offs
        kin = kpos <= last
        krow = (b * T + kpos) * NHK + hk
        km = kin[:, None] & dmask[None, :]
        k = tl.load(k_ptr + krow[:, None] * D + d[None, :], mask=km, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + krow[:, None] * D + d[None, :], mask=km, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        valid = kpos[None, :] <= pos[:, None]
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds, k, input_precision="ieee")
    tl.store(dq_ptr + row[:, None] * D + d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _attn_bwd_dkv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, T, NHQ, NHK, D, G, scale,
                  BR: tl.constexpr, BD: tl.constexpr, C: tl.constexpr, TQ: tl.constexpr):
    """Program: (sequence b, key chunk j, kv head); walks the query tiles that can see the chunk, in order."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    hk = tl.program_id(2)
    kpos = j * C + tl.arange(0, C)
    kin = kpos < T
    d = tl.arange(0, BD)
    dmask = d < D
    krow = (b * T + kpos) * NHK + hk
    km = kin[:, None] & dmask[None, :]
    k = tl.load(k_ptr + krow[:, None] * D + d[None, :], mask=km, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + krow[:, None] * D + d[None, :], mask=km, other=0.0).to(tl.float32)
    dk = tl.zeros((C, BD), dtype=tl.float32)
    dv = tl.zeros((C, BD), dtype=tl.float32)
    r = tl.arange(0, BR)
    for i in range((j * C) // TQ, (T + TQ - 1) // TQ):
        t = i * TQ + r // G
        head = hk * G + r % G
        rvalid = (t < T) & (r < TQ * G)
        row = (b * T + t) * NHQ + head
        m2 = rvalid[:, None] & dmask[None, :]
        q = tl.load(q_ptr + row[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + row[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + row, mask=rvalid, other=0.0)
        delta = tl.load(delta_ptr + row, mask=rvalid, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        valid = (kpos[None, :] <= t[:, None]) & rvalid[:, None] & kin[None, :]
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p), do, input_precision="ieee")
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds), q, input_precision="ieee")
    tl.store(dk_ptr + krow[:, None] * D + d[None, :], (dk * scale).to(dk_ptr.dtype.element_ty), mask=km)
    tl.store(dv_ptr + krow[:, None] * D + d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=km)


class _DenseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):
        b, t, h_q, d = q.shape
        h_kv = k.shape[2]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # dense keys as a paged store: block = sequence, slot = position ([B, Hkv, T, D] strides of [B, T, Hkv, D])
        k_store = k.as_strided((b, h_kv, t, d), (t * h_kv * d, d, h_kv * d, 1))
        v_store = v.as_strided((b, h_kv, t, d), (t * h_kv * d, d, h_kv * d, 1))
        q_pos = torch.arange(t, device=q.device).repeat(b)
        q_lens = torch.full((b,), t, dtype=torch.long)
        block_table = torch.arange(b, device=q.device).reshape(b, 1)
        out, lse = _forward(q.reshape(b * t, h_q, d), k_store, v_store, q_pos, q_lens, block_table, t, scale)
        out = out.reshape(b, t, h_q, d)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        b, t, h_q, d = q.shape
        h_kv = k.shape[2]
        g = h_q // h_kv
        do = do.contiguous()
        delta = (do.float() * out.float()).sum(-1).reshape(-1).contiguous()  # [B*T*Hq]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        meta = dict(BR=next_pow2(Q_TILE * g), BD=next_pow2(d), C=KEY_CHUNK, TQ=Q_TILE)
        _attn_bwd_dq[(b, triton.cdiv(t, Q_TILE), h_kv)](q, k, v, do, lse, delta, dq, t, h_q, h_kv, d, g, ctx.scale,
                                                         **meta)
        _attn_bwd_dkv[(b, triton.cdiv(t, KEY_CHUNK), h_kv)](q, k, v, do, lse, delta, dk, dv, t, h_q, h_kv, d, g,
                                                             ctx.scale, **meta)
        return dq, dk, dv, None


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Triton :func:`shared_numerics.attention.dense_causal_attention` (``[B, T, H, D]``; differentiable)."""
    return _DenseAttention.apply(q, k, v, float(scale))


def paged_causal_attention(q, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale):
    """Triton :func:`shared_numerics.attention.paged_causal_attention` (vLLM's ``[blocks, Hkv, block_size, D]``
    cache; any block size). Inference only."""
    qsl = query_start_loc.long().cpu()
    q_lens = qsl[1:] - qsl[:-1]
    n_q = q.shape[0]
    q_seq = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
    q_pos = (seq_lens.long().cpu() - q_lens)[q_seq] + (torch.arange(n_q) - qsl[:-1][q_seq])
    out, _ = _forward(q.contiguous(), key_cache, value_cache, q_pos.to(q.device), q_lens, block_table,
                      key_cache.shape[2], float(scale))
    return out
