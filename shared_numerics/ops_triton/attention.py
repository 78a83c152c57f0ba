"""Causal attention with fixed key splits (FlashAttention-2 forward and backward on tensor cores), shared by the
trainer's dense sequences and vLLM's paged KV cache.

The contract, for a query at absolute position ``p`` of its sequence (whatever the batch, the block size or how many
programs run):

* keys are cut at absolute positions ``k * SPLIT`` (:data:`SPLIT` = 512): split ``k`` holds keys
  ``[k*SPLIT, (k+1)*SPLIT)``; the query needs splits ``0 .. p // SPLIT``;
* inside a split, keys are walked in ``block_n``-key chunks (64 for bf16/fp16, 32 for fp32: :data:`CONFIGS`) in
  increasing order with the online softmax
  (running max ``m``, normaliser ``l``, accumulator ``acc``; fp32, base-2 exponentials): scores ``q·k`` are one
  tensor-core dot (bf16/fp16 operands, fp32 accumulation; fp32 models use exact ``ieee`` dots), the chunk's max is
  ``max(s) * scale`` (equal to ``max(s * scale)``: rounding is monotone, the scale positive), ``p = exp2(fma(s,
  scale, -m))``, ``l = fma(l, alpha, sum(p))``, ``p`` is rounded to the value dtype for ``p·v`` (FlashAttention-2);
  every fused multiply-add is written out and the compiler fuses nothing else (``enable_fp_fusion=False``);
* the splits' states are merged in increasing split order, starting from the empty state, by one merge function
  (:func:`_merge`), and the output is ``acc / l`` (IEEE division).

Two ways to run the splits give the same bits, because the arithmetic is literally the same: one program walks all of
a tile's splits and merges them in registers (prefill, the trainer's dense path, backward-saving forward); or one
program per split writes its state and :func:`_attn_combine` merges them (decodes: the context is parallelised over
splits — FlashDecoding with a *fixed* split size, never chosen from the batch). Both paths run the same compiled
kernel (:func:`_attn_fwd`, the split count per program is a runtime argument), merging an empty state is an exact
no-op (``max`` is exact, a factor of exactly 1 or 0), and key chunks past a query's position are exact no-ops too, so
a query's bits do not depend on which other queries share its tile either.

A program owns one tile: ``block_m`` rows (prefill 128 and decode 64 for bf16/fp16, 32 for fp32), each row one
(query, query head) pair —
``block_m // G`` consecutive queries of one sequence times the ``G`` query heads of one kv head (grouped-query
attention: the K/V chunk loaded once serves all of them). Sequences are found from ``query_start_loc`` inside the kernel
(tile ``t`` belongs to the last sequence ``s`` with ``query_start_loc[s] // Q + s <= t``, the upper-bound grid of vLLM's
unified attention), so the host launches ``N_q // Q + num_seqs`` tile programs (last first: the causal mask makes late
tiles the longest) and builds no maps: no host sync, CUDA-graph capturable. Keys are addressed through a block table in
both layouts: vLLM's paged ``[blocks, kv_heads, block_size, D]`` cache (any block size and strides; power-of-two sizes
compiled in) and the trainer's dense ``[B, T, kv_heads, D]`` keys seen as one ``T``-token block per sequence (addressed
directly).

Backward (dense layout): FlashAttention-2 (Dao 2023): ``dQ`` per query tile, ``dK``/``dV`` per (sequence, key
chunk, kv head) walking the query tiles in order, both recomputing ``p = exp2(s - lse)`` from the forward's saved
log-sum-exp; tensor-core dots, no atomics: deterministic.

Against the torch backend (32-key chunks, fp32 ``p``, float64 exponentials) results agree to bf16/fp32 rounding, not
bitwise: trainer and engine must run the same backend. Sources: Dao, "FlashAttention-2" (2023); Dao et al.,
"Flash-Decoding" (2023), with the fixed split size of SGLang's deterministic mode; vLLM
``v1/attention/ops/triton_unified_attention.py`` (tile search, paged loads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["CONFIGS", "AttnConfig", "SPLIT", "dense_causal_attention", "paged_causal_attention", "queries_per_tile"]

from ..attention import SPLIT  # keys per split (absolute positions); part of the numerics contract


@dataclass(frozen=True)
class AttnConfig:
    """One fixed configuration per dtype. ``block_n`` (keys per chunk) is part of the numerics contract — every launch
    of a dtype walks the same chunks. ``block_m`` (rows per tile) only decides which rows share a program: rows of an
    MMA are independent and Hopper issues the same ``wgmma`` m64 instruction per warpgroup for 64- and 128-row tiles,
    so a row's bits do not depend on it (measured: ``triton_attention_configs`` in
    ``benchmarks/results/gpu_kernels_h200.json``, every 64-row variant bitwise the 128-row kernel on an H200; the GPU
    tests compare dense 128-row tiles with 64-row decode tiles). Warps and stages only schedule. ``decode_*``: the
    tile of split-KV launches (decode-like batches), where a tile holds few valid rows and more programs per SM pay:
    bf16 64-row tiles of 4 warps read the paged cache at 1160 GB/s on an H200 vs 730 for 128-row tiles of 8. Prefill
    runs 3 stages (8% faster than 2 there). bf16 128x64 runs the forward at the register ceiling without spilling
    (``zerokld_testing/triton_aot.py``); fp32 (exact ``ieee`` dots on CUDA cores, for tests and fp32 models, not a
    speed target) uses 32x32 tiles: 128x64 would need more shared memory than an SM has (263 KB in the dK/dV kernel),
    32x32 fits (<= 74 KB) with a small forward spill. Its backward runs one stage: Triton 3.9 pipelines the two-stage
    dK/dV kernel into 32 registers and ~5 KB of spills per thread (3.8: none)."""

    block_m: int
    block_n: int
    fwd_warps: int
    fwd_stages: int
    bwd_warps: int
    bwd_stages: int
    decode_block_m: int
    decode_warps: int
    decode_stages: int


CONFIGS = {
    torch.bfloat16: AttnConfig(128, 64, 8, 3, 8, 2, 64, 4, 3),
    torch.float16: AttnConfig(128, 64, 8, 3, 8, 2, 64, 4, 3),
    torch.float32: AttnConfig(32, 32, 8, 2, 8, 1, 32, 8, 2),
}
_LOG2E = 1.4426950408889634


def _config(dtype: torch.dtype) -> AttnConfig:
    if dtype not in CONFIGS:
        raise TypeError(f"attention supports {sorted(map(str, CONFIGS))}, got {dtype}")
    return CONFIGS[dtype]


def queries_per_tile(group: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Queries per tile for ``group`` query heads per kv head (``block_m // group`` of ``dtype``'s config).

    Raises:
        ValueError: ``group`` exceeds the tile's rows.
    """
    block_m = _config(dtype).block_m
    if group > block_m:
        raise ValueError(f"{group} query heads per kv head exceed the {block_m}-row {dtype} attention tile")
    return block_m // group


@triton.jit
def _find_seq(qsl_ptr, tile, num_seqs, QT, PAD: tl.constexpr):
    """The last sequence ``s`` with ``qsl[s] // QT + PAD * s <= tile`` (binary search): the owner of tile ``tile``
    (``PAD = 1``), or of query token ``tile`` (``QT = 1``, ``PAD = 0``)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // QT + PAD * mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _merge(m, l, acc, m2, l2, acc2):
    """Merge two online-softmax states (base-2 max ``m``, normaliser ``l``, accumulator ``acc [rows, D]``).

    Exact when either side is empty (``m = -inf``, ``l = 0``, ``acc = 0``): factors are exactly 1 or 0. Used by
    the in-program split loop and by :func:`_attn_combine`, so both give the same bits."""
    m_new = tl.maximum(m, m2)
    a = tl.where(m == m_new, 1.0, tl.exp2(m - _finite(m_new)))
    b = tl.where(m2 == m_new, 1.0, tl.exp2(m2 - _finite(m_new)))
    l_new = tl.fma(l, a, l2 * b)
    acc_new = tl.fma(acc, a[:, None], acc2 * b[:, None])
    return m_new, l_new, acc_new


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b``: exact fp32 products for fp32 models (``ieee``), else a tensor-core dot with ``a`` rounded to
    ``b``'s dtype (FlashAttention-2 rounds the probabilities / their gradients to the value dtype)."""
    if IEEE:  # noqa: SIM108 - a constexpr if: Triton compiles only the branch taken
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a.to(b.dtype), b, acc)
    return out


@triton.jit
def _finite(m):
    """``m`` with ``-inf`` (a row without keys yet) read as 0, so ``x - m`` never is ``-inf - -inf``."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _finalize(l, acc):
    l_safe = tl.where(l > 0, l, 1.0)  # rows without keys (tile padding) stay finite; they are never stored
    return tl.div_rn(acc, l_safe[:, None])


@triton.jit(do_not_specialize=["num_seqs", "splits_per_program", "n_groups", "block_size", "G"])
def _attn_fwd(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    mp_ptr,
    lp_ptr,
    ap_ptr,
    qsl_ptr,
    sl_ptr,
    bt_ptr,
    num_seqs,
    splits_per_program,
    n_groups,
    G,
    NHQ,
    D,
    sqt,
    sqh,
    sot,
    soh,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sbt,
    block_size,
    qk_scale,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    SPLIT_: tl.constexpr,
    IEEE: tl.constexpr,
    STORE_LSE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (tile, kv head, split group): splits ``[g * splits_per_program, ...)`` of one tile."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # last tiles (the longest: causal) first
    hk = tl.program_id(1)
    grp = tl.program_id(2)
    QT = BM // G
    seq = _find_seq(qsl_ptr, tile, num_seqs, QT, 1)
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    q0 = q_start + (tile - (q_start // QT + seq)) * QT
    if q0 >= q_end:
        return
    nq = tl.minimum(QT, q_end - q0)
    first_pos = tl.load(sl_ptr + seq) - (q_end - q_start) + (q0 - q_start)  # position of query q0
    pmax = first_pos + nq - 1
    n_splits = pmax // SPLIT_ + 1
    s_lo = grp * splits_per_program
    if s_lo >= n_splits:
        return
    s_hi = tl.minimum(s_lo + splits_per_program, n_splits)

    r = tl.arange(0, BM)
    qi = r // G
    head = hk * G + r % G
    rvalid = (qi < nq) & (r < QT * G)
    pos = tl.where(rvalid, first_pos + qi, -1)
    d = tl.arange(0, BD)
    dmask = d < D
    token = (q0 + qi).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * sqt + head[:, None] * sqh + d[None, :],
        mask=rvalid[:, None] & dmask[None, :],
        other=0.0,
    )
    offs = tl.arange(0, BN)
    k_base = k_ptr + hk * skh
    v_base = v_ptr + hk * svh
    if BLOCK == 0:
        dense_blk = tl.load(bt_ptr + seq * sbt).to(tl.int64)
        k_base += dense_blk * skb
        v_base += dense_blk * svb
    m_run = tl.full((BM,), float("-inf"), tl.float32)
    l_run = tl.zeros((BM,), dtype=tl.float32)
    acc_run = tl.zeros((BM, BD), dtype=tl.float32)
    for sp in range(s_lo, s_hi):
        m_i = tl.full((BM,), float("-inf"), tl.float32)
        l_i = tl.zeros((BM,), dtype=tl.float32)
        acc = tl.zeros((BM, BD), dtype=tl.float32)
        k_hi = tl.minimum((sp + 1) * SPLIT_, pmax + 1)
        for k0 in tl.range(sp * SPLIT_, k_hi, BN):
            kpos = k0 + offs
            kin = kpos <= pmax  # keys of this tile's context: written, finite; the rest are loaded as 0
            kmask = kin[:, None] & dmask[None, :]
            if BLOCK == 0:  # dense: one block per sequence, the slot is the position
                koff = kpos[:, None].to(tl.int64) * skt + d[None, :]
                voff = kpos[:, None].to(tl.int64) * svt + d[None, :]
            else:
                if BLOCK > 0:  # a power-of-two block size known at compile time: shifts and masks
                    blk = tl.load(bt_ptr + seq * sbt + kpos // BLOCK, mask=kin, other=0).to(tl.int64)
                    slot = kpos % BLOCK
                else:
                    blk = tl.load(bt_ptr + seq * sbt + kpos // block_size, mask=kin, other=0).to(tl.int64)
                    slot = kpos % block_size
                koff = blk[:, None] * skb + slot[:, None] * skt + d[None, :]
                voff = blk[:, None] * svb + slot[:, None] * svt + d[None, :]
            k = tl.load(k_base + koff, mask=kmask, other=0.0)
            v = tl.load(v_base + voff, mask=kmask, other=0.0)
            s = _mma(q, tl.trans(k), tl.zeros((BM, BN), dtype=tl.float32), IEEE)
            s = tl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # == max(s * qk_scale): rounding is monotone
            m_fin = _finite(m_new)
            alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_fin))
            p = tl.exp2(tl.fma(s, qk_scale, -m_fin[:, None]))
            l_i = tl.fma(l_i, alpha, tl.sum(p, axis=1))
            acc = _mma(p, v, acc * alpha[:, None], IEEE)
            m_i = m_new
        m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m_i, l_i, acc)

    # every split of the row merged here; the scalar test is broadcast to a block first (``r * 0 + s_lo``): a scalar
    # comparison in a block ``&`` is promoted to int32 by Triton 3.9, whose masked store then refuses the mask
    done = rvalid & (r * 0 + s_lo == 0) & (pos // SPLIT_ + 1 <= s_hi)
    out = _finalize(l_run, acc_run)
    tl.store(
        o_ptr + token[:, None] * sot + head[:, None] * soh + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=done[:, None] & dmask[None, :],
    )
    if STORE_LSE:
        tl.store(lse_ptr + token * NHQ + head, m_run + tl.log2(tl.where(l_run > 0, l_run, 1.0)), mask=done)
    part = rvalid & ~done  # rows with splits in other programs: this group's state goes to the combine kernel
    pidx = (token * NHQ + head) * n_groups + grp
    tl.store(mp_ptr + pidx, m_run, mask=part)
    tl.store(lp_ptr + pidx, l_run, mask=part)
    tl.store(ap_ptr + pidx[:, None] * D + d[None, :], acc_run, mask=part[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["num_seqs", "n_groups"])
def _attn_combine(
    o_ptr,
    mp_ptr,
    lp_ptr,
    ap_ptr,
    qsl_ptr,
    sl_ptr,
    num_seqs,
    n_groups,
    NHQ,
    D,
    sot,
    soh,
    BH: tl.constexpr,
    BD: tl.constexpr,
    SPLIT_: tl.constexpr,
):
    """Program (query token): merge its heads' split states in increasing split order (one split per group)."""
    token = tl.program_id(0)
    seq = _find_seq(qsl_ptr, token, num_seqs, 1, 0)
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    pos = tl.load(sl_ptr + seq) - (q_end - q_start) + (token - q_start)
    n = pos // SPLIT_ + 1
    if n <= 1:
        return  # a single split: the split program wrote the output
    h = tl.arange(0, BH)
    hmask = h < NHQ
    d = tl.arange(0, BD)
    m2 = hmask[:, None] & (d[None, :] < D)
    base = (token.to(tl.int64) * NHQ + h) * n_groups
    m = tl.full((BH,), float("-inf"), tl.float32)
    l = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, BD), dtype=tl.float32)
    for sp in range(0, n):
        ms = tl.load(mp_ptr + base + sp, mask=hmask, other=float("-inf"))
        ls = tl.load(lp_ptr + base + sp, mask=hmask, other=0.0)
        accs = tl.load(ap_ptr + (base + sp)[:, None] * D + d[None, :], mask=m2, other=0.0)
        m, l, acc = _merge(m, l, acc, ms, ls, accs)
    out = _finalize(l, acc)
    tl.store(o_ptr + token * sot + h[:, None] * soh + d[None, :], out.to(o_ptr.dtype.element_ty), mask=m2)


def _tile(dtype: torch.dtype, group: int, split_kv: bool) -> tuple[int, int, int]:
    """``(block_m, num_warps, num_stages)`` of a forward launch: the decode tile for split-KV launches whose kv-head
    group fits it, else the prefill tile."""
    cfg = _config(dtype)
    if split_kv and group <= cfg.decode_block_m:
        return cfg.decode_block_m, cfg.decode_warps, cfg.decode_stages
    queries_per_tile(group, dtype)  # raises for a group larger than the tile
    return cfg.block_m, cfg.fwd_warps, cfg.fwd_stages


def _block_key(block_size: int, dense: bool) -> int:
    """The kernel's ``BLOCK`` specialisation (addressing only, never the arithmetic): 0 for dense sequences (one
    block each), the block size for vLLM's power-of-two sizes up to 1024, -1 (read at run time) otherwise."""
    if dense:
        return 0
    return block_size if block_size & (block_size - 1) == 0 and 0 < block_size <= 1024 else -1


def _forward(
    q,
    k_store,
    v_store,
    query_start_loc,
    seq_lens,
    block_table,
    block_size,
    scale,
    max_seq_len,
    split_kv: bool,
    store_lse: bool,
    dense: bool = False,
):
    """``q [Nq, Hq, D]`` (head stride may be anything, last stride 1); ``k_store``/``v_store``
    ``[blocks, Hkv, slot, D]``-strided. Returns ``(out [Nq, Hq, D], lse2 [Nq, Hq] base-2 or None)``."""
    n_q, h_q, d = q.shape
    h_kv = k_store.shape[1]
    if h_q % h_kv:
        raise ValueError(f"query heads {h_q} not a multiple of kv heads {h_kv}")
    if q.dtype != k_store.dtype or q.dtype != v_store.dtype:
        raise TypeError(f"attention operands must share a dtype: q {q.dtype}, k {k_store.dtype}, v {v_store.dtype}")
    if q.stride(-1) != 1 or k_store.stride(-1) != 1 or v_store.stride(-1) != 1:
        raise ValueError("attention needs unit stride along head_dim")
    g = h_q // h_kv
    block_m, warps, stages = _tile(q.dtype, g, split_kv)
    qt = block_m // g
    out = torch.empty((n_q, h_q, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((n_q, h_q), dtype=torch.float32, device=q.device) if store_lse else None
    num_seqs = query_start_loc.shape[0] - 1
    if n_q == 0 or num_seqs == 0:
        return out, lse
    max_splits = max(1, triton.cdiv(int(max_seq_len), SPLIT))
    n_groups = max_splits if split_kv and max_splits > 1 else 1
    if n_groups > 1:
        mp = torch.empty((n_q, h_q, n_groups), dtype=torch.float32, device=q.device)
        lp = torch.empty_like(mp)
        ap = torch.empty((n_q, h_q, n_groups, d), dtype=torch.float32, device=q.device)
    else:
        mp = lp = ap = out  # never written: every row is finished by its one program
    qsl = query_start_loc.to(device=q.device, dtype=torch.int32)
    sl = seq_lens.to(device=q.device, dtype=torch.int32)
    bt = block_table.to(device=q.device, dtype=torch.int32)
    bd = triton.next_power_of_2(d)
    grid = (n_q // qt + num_seqs, h_kv, n_groups)
    _attn_fwd[grid](
        q,
        k_store,
        v_store,
        out,
        lse if lse is not None else out,
        mp,
        lp,
        ap,
        qsl,
        sl,
        bt,
        num_seqs,
        max_splits if n_groups == 1 else 1,
        n_groups,
        g,
        h_q,
        d,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_store.stride(0),
        k_store.stride(1),
        k_store.stride(2),
        v_store.stride(0),
        v_store.stride(1),
        v_store.stride(2),
        bt.stride(0),
        block_size,
        float(scale) * _LOG2E,
        BM=block_m,
        BN=_config(q.dtype).block_n,
        BD=bd,
        SPLIT_=SPLIT,
        IEEE=q.dtype == torch.float32,
        STORE_LSE=store_lse,
        BLOCK=_block_key(block_size, dense),
        num_warps=warps,
        num_stages=stages,
        enable_fp_fusion=False,
    )
    if n_groups > 1:
        _attn_combine[(n_q,)](
            out,
            mp,
            lp,
            ap,
            qsl,
            sl,
            num_seqs,
            n_groups,
            h_q,
            d,
            out.stride(0),
            out.stride(1),
            BH=triton.next_power_of_2(h_q),
            BD=bd,
            SPLIT_=SPLIT,
        )
    return out, lse


@triton.jit(do_not_specialize=["T"])
def _attn_bwd_dq(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    T,
    NHQ,
    NHK,
    D,
    G,
    qk_scale,
    scale,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Dense ``[B, T, H, D]`` contiguous. Program: (sequence b, query tile i, kv head)."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    hk = tl.program_id(2)
    QT = BM // G
    r = tl.arange(0, BM)
    t = i * QT + r // G
    head = hk * G + r % G
    rvalid = (t < T) & (r < QT * G)
    d = tl.arange(0, BD)
    dmask = d < D
    row = (b * T + t).to(tl.int64) * NHQ + head
    m2 = rvalid[:, None] & dmask[None, :]
    q = tl.load(q_ptr + row[:, None] * D + d[None, :], mask=m2, other=0.0)
    do = tl.load(do_ptr + row[:, None] * D + d[None, :], mask=m2, other=0.0)
    lse = tl.load(lse_ptr + row, mask=rvalid, other=0.0)
    delta = tl.load(delta_ptr + row, mask=rvalid, other=0.0)
    pos = tl.where(rvalid, t, -1)
    last = tl.minimum(i * QT + QT - 1, T - 1)
    dq = tl.zeros((BM, BD), dtype=tl.float32)
    offs = tl.arange(0, BN)
    for k0 in tl.range(0, last + 1, BN):
        kpos = k0 + offs
        kin = kpos <= last
        krow = (b * T + kpos).to(tl.int64) * NHK + hk
        km = kin[:, None] & dmask[None, :]
        k = tl.load(k_ptr + krow[:, None] * D + d[None, :], mask=km, other=0.0)
        v = tl.load(v_ptr + krow[:, None] * D + d[None, :], mask=km, other=0.0)
        zero = tl.zeros((BM, BN), dtype=tl.float32)
        s = _mma(q, tl.trans(k), zero, IEEE)
        dp = _mma(do, tl.trans(v), zero, IEEE)
        p = tl.where(kpos[None, :] <= pos[:, None], tl.exp2(tl.fma(s, qk_scale, -lse[:, None])), 0.0)
        dq = _mma(p * (dp - delta[:, None]), k, dq, IEEE)
    tl.store(dq_ptr + row[:, None] * D + d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=m2)


@triton.jit(do_not_specialize=["T"])
def _attn_bwd_dkv(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    T,
    NHQ,
    NHK,
    D,
    G,
    qk_scale,
    scale,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Program: (sequence b, key chunk j, kv head); walks the query tiles that can see the chunk, in order."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    hk = tl.program_id(2)
    QT = BM // G
    kpos = j * BN + tl.arange(0, BN)
    kin = kpos < T
    d = tl.arange(0, BD)
    dmask = d < D
    krow = (b * T + kpos).to(tl.int64) * NHK + hk
    km = kin[:, None] & dmask[None, :]
    k = tl.load(k_ptr + krow[:, None] * D + d[None, :], mask=km, other=0.0)
    v = tl.load(v_ptr + krow[:, None] * D + d[None, :], mask=km, other=0.0)
    dk = tl.zeros((BN, BD), dtype=tl.float32)
    dv = tl.zeros((BN, BD), dtype=tl.float32)
    r = tl.arange(0, BM)
    for i in range((j * BN) // QT, tl.cdiv(T, QT)):
        t = i * QT + r // G
        head = hk * G + r % G
        rvalid = (t < T) & (r < QT * G)
        row = (b * T + t).to(tl.int64) * NHQ + head
        m2 = rvalid[:, None] & dmask[None, :]
        q = tl.load(q_ptr + row[:, None] * D + d[None, :], mask=m2, other=0.0)
        do = tl.load(do_ptr + row[:, None] * D + d[None, :], mask=m2, other=0.0)
        lse = tl.load(lse_ptr + row, mask=rvalid, other=0.0)
        delta = tl.load(delta_ptr + row, mask=rvalid, other=0.0)
        zero = tl.zeros((BM, BN), dtype=tl.float32)
        s = _mma(q, tl.trans(k), zero, IEEE)
        dp = _mma(do, tl.trans(v), zero, IEEE)
        valid = (kpos[None, :] <= t[:, None]) & rvalid[:, None] & kin[None, :]
        p = tl.where(valid, tl.exp2(tl.fma(s, qk_scale, -lse[:, None])), 0.0)
        dv = _mma(tl.trans(p), do, dv, IEEE)
        dk = _mma(tl.trans(p * (dp - delta[:, None])), q, dk, IEEE)
    tl.store(dk_ptr + krow[:, None] * D + d[None, :], (dk * scale).to(dk_ptr.dtype.element_ty), mask=km)
    tl.store(dv_ptr + krow[:, None] * D + d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=km)


def _dense_metadata(b: int, t: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense sequences as a paged batch: one ``T``-token block per sequence, all queries scheduled."""
    qsl = torch.arange(b + 1, device=device, dtype=torch.int32) * t
    seq_lens = torch.full((b,), t, device=device, dtype=torch.int32)
    block_table = torch.arange(b, device=device, dtype=torch.int32).reshape(b, 1)
    return qsl, seq_lens, block_table


class _DenseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):
        b, t, h_q, d = q.shape
        h_kv = k.shape[2]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # dense keys as a paged store: block = sequence, slot = position ([B, Hkv, T, D] strides of [B, T, Hkv, D])
        k_store = k.as_strided((b, h_kv, t, d), (t * h_kv * d, d, h_kv * d, 1))
        v_store = v.as_strided((b, h_kv, t, d), (t * h_kv * d, d, h_kv * d, 1))
        qsl, seq_lens, block_table = _dense_metadata(b, t, q.device)
        out, lse = _forward(
            q.reshape(b * t, h_q, d),
            k_store,
            v_store,
            qsl,
            seq_lens,
            block_table,
            t,
            scale,
            t,
            split_kv=False,
            store_lse=True,
            dense=True,
        )
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
        cfg = _config(q.dtype)
        qt = queries_per_tile(g, q.dtype)
        do = do.to(q.dtype).contiguous()
        delta = (do.float() * out.float()).sum(-1).reshape(-1).contiguous()  # [B*T*Hq]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        meta = dict(
            BM=cfg.block_m,
            BN=cfg.block_n,
            BD=triton.next_power_of_2(d),
            IEEE=q.dtype == torch.float32,
            num_warps=cfg.bwd_warps,
            num_stages=cfg.bwd_stages,
            enable_fp_fusion=False,
        )
        args = (t, h_q, h_kv, d, g, ctx.scale * _LOG2E, ctx.scale)
        _attn_bwd_dq[(b, triton.cdiv(t, qt), h_kv)](q, k, v, do, lse, delta, dq, *args, **meta)
        _attn_bwd_dkv[(b, triton.cdiv(t, cfg.block_n), h_kv)](q, k, v, do, lse, delta, dk, dv, *args, **meta)
        return dq, dk, dv, None


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Triton :func:`shared_numerics.attention.dense_causal_attention`: ``q [B, T, Hq, D]``, ``k, v [B, T, Hkv, D]``
    (one dtype) -> ``[B, T, Hq, D]``. Row ``(b, t)`` is bitwise :func:`paged_causal_attention`'s for the same prefix.
    Differentiable (FlashAttention-2 backward, deterministic).

    Raises:
        ValueError / TypeError: incompatible head counts or dtypes."""
    return _DenseAttention.apply(q, k, v, float(scale))


def paged_causal_attention(
    q,
    key_cache,
    value_cache,
    query_start_loc,
    seq_lens,
    block_table,
    scale,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
):
    """Triton :func:`shared_numerics.attention.paged_causal_attention` over vLLM's cache (inference only).

    Args:
        q: ``[Nq, Hq, D]`` the scheduled tokens, request after request.
        key_cache, value_cache: ``[num_blocks, Hkv, block_size, D]``, any block size and strides (unit stride on
            ``D``), same dtype as ``q``; the scheduled tokens' keys already written.
        query_start_loc: ``[num_reqs + 1]`` int; seq_lens: ``[num_reqs]`` int (context incl. scheduled tokens);
            block_table: ``[num_reqs, max_blocks]`` int. Device tensors (host tensors are copied over).
        scale: softmax scale.
        max_query_len, max_seq_len: host ints (vLLM's metadata has them); ``None`` reads them from the tensors
            (a device-to-host sync). They size the launch only (never the arithmetic): decode-like batches
            (``max_query_len`` <= one tile) run one program per split plus the combine kernel, others one program
            per tile. A CUDA-graph capture must pass the largest ``max_seq_len`` it will replay.

    Returns:
        ``[Nq, Hq, D]`` in ``q.dtype``, bitwise :func:`dense_causal_attention`'s rows for the same prefixes.
    """
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    if max_query_len is None:
        qsl = query_start_loc.long()
        max_query_len = int((qsl[1:] - qsl[:-1]).max().item()) if qsl.numel() > 1 else 0
    g = q.shape[1] // key_cache.shape[1]
    split_kv = g <= _config(q.dtype).decode_block_m and max_query_len <= _config(q.dtype).decode_block_m // g
    out, _ = _forward(
        q,
        key_cache,
        value_cache,
        query_start_loc,
        seq_lens,
        block_table,
        key_cache.shape[2],
        scale,
        max_seq_len,
        split_kv=split_kv,
        store_lse=False,
    )
    return out
