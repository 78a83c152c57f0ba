"""A Qwen3-style decoder built only from a numerics op table, with a trainer path and a rollout path.

For machines that have the kernels but neither vLLM nor TorchTitan (a lent GPU box), and for the layer benchmark:

* :meth:`OpModel.trainer_logprobs` — the training side: right-padded dense sequences, TorchTitan's op order
  (``h + attn`` then ``rms_norm``; ``rms_norm`` then ``apply_rope`` for QK-norm; dense causal attention), selected
  log-probs of every next token.
* :func:`rollout` — the serving side: a small continuous-batching engine with vLLM's mechanics — a paged KV cache
  (``[blocks, kv_heads, block_size, 2 * head_dim]`` per layer, K|V content, blocks handed out in shuffled order),
  requests that arrive at different steps, chunked prefill under a token budget co-batched with decodes, finished
  requests leaving — and vLLM's op order (fused ``add_rms_norm``, fused ``rms_norm_rope``, paged attention with
  host-side ``max_query_len``/``max_seq_len``, ``log_softmax`` of the last position's logits).

Sampling is greedy or the counter-based sampler (:mod:`shared_numerics.sampling`). With one op table for both paths,
the log-prob the engine reports for each generated token must equal, bitwise, the trainer's log-prob of that token.
:data:`STOCK_OPS` is the negative control: the same model on stock PyTorch ops (``F.linear``, ``F.rms_norm``, SDPA,
per-request attention over the gathered cache), which do not agree with themselves across the two paths.
Weights are random (``init_std``), shapes any: :data:`QWEN3_8B` gives the layer shapes of Qwen3-8B.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import shared_numerics as sn
from shared_numerics import sampling

__all__ = [
    "OpModel",
    "OpModelSpec",
    "QWEN3_8B",
    "STOCK_OPS",
    "RolloutResult",
    "peft_lora_linear",
    "rollout",
    "stock_layer",
]


@dataclass(frozen=True)
class OpModelSpec:
    """Decoder dimensions (HF ``Qwen3Config`` names)."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    qk_norm: bool = True
    init_std: float = 0.05


QWEN3_8B = OpModelSpec(
    vocab_size=151936,
    hidden_size=4096,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    init_std=0.02,
)


def _stock_rms_norm(x, w, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


def _stock_rope(x, cos, sin):
    half = x.shape[-1] // 2
    c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _stock_dense_attention(q, k, v, scale):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def _stock_paged_attention(
    q, key_cache, value_cache, query_start_loc, seq_lens, block_table, scale, max_query_len=None, max_seq_len=None
):
    """Per request: gather its keys from the cache, SDPA with the causal offset (the stock way to read a cache)."""
    out = torch.empty_like(q)
    bs = key_cache.shape[2]
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r in range(len(lens)):
        a, b, n = qsl[r], qsl[r + 1], lens[r]
        pos = torch.arange(n, device=q.device)
        blocks, slots = block_table[r, pos // bs].long(), pos % bs
        k = key_cache[blocks, :, slots]  # [n, Hkv, D]
        v = value_cache[blocks, :, slots]
        qpos = torch.arange(n - (b - a), n, device=q.device)
        mask = pos[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[a:b] = o[0].transpose(0, 1)
    return out


def _stock_add_rms_norm(x, r, w, eps):
    s = x + r
    return s, _stock_rms_norm(s, w, eps)


def peft_lora_linear(linear, x, w, b, lora_a, lora_b, scaling, adapter_ids):
    """PEFT's ``Linear.forward`` arithmetic (``base + lora_B(lora_A(x)) * scaling``, each op in ``x.dtype``) on a given
    ``linear(x, w, b=None)``, one call per adapter's rows — how a stock multi-LoRA layer batches. On ATen's
    ``F.linear`` it is the stock control for :func:`shared_numerics.lora_linear`; on ``shared_numerics.linear`` it is
    that op's definition, computed another way."""
    y = linear(x, w, b)
    out = y.clone()
    for j in torch.unique(adapter_ids).tolist():
        if j >= 0:
            rows = adapter_ids == j
            out[rows] = y[rows] + linear(linear(x[rows], lora_a[j]), lora_b[j]) * float(scaling[j])
    return out


def _stock_linear(x, w, b=None):
    return F.linear(x, w.to(x.dtype), b)


STOCK_OPS = {
    "linear": _stock_linear,
    "lora_linear": lambda *args: peft_lora_linear(_stock_linear, *args),
    "rms_norm": _stock_rms_norm,
    "add_rms_norm": _stock_add_rms_norm,
    "rms_norm_rope": lambda x, w, eps, cos, sin: _stock_rope(_stock_rms_norm(x, w, eps), cos, sin),
    "rope_cos_sin": sn.rope_cos_sin,
    "apply_rope": _stock_rope,
    "silu_and_mul": lambda g, u: F.silu(g) * u,
    "log_softmax": lambda z: torch.log_softmax(z.float(), -1),
    "selected_logprobs": lambda z, t: torch.log_softmax(z.float(), -1).gather(-1, t.reshape(-1, 1).long())[:, 0],
    "dense_causal_attention": _stock_dense_attention,
    "paged_causal_attention": _stock_paged_attention,
}


class OpModel:
    """Random-weight Qwen3-style decoder on an op table (``ops``: a table like ``shared_numerics.ops_torch.OPS``,
    :data:`STOCK_OPS`, or ``None`` for the dispatching public functions of :mod:`shared_numerics`)."""

    def __init__(
        self,
        spec: OpModelSpec,
        dtype: torch.dtype = torch.bfloat16,
        device="cpu",
        seed: int = 0,
        ops: dict | None = None,
        num_layers: int | None = None,
    ) -> None:
        self.spec, self.dtype, self.device = spec, dtype, torch.device(device)
        self.ops = ops if ops is not None else {name: getattr(sn, name) for name in sn.OP_NAMES}
        self.num_layers = spec.num_hidden_layers if num_layers is None else num_layers
        g = torch.Generator(device="cpu").manual_seed(seed)
        h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
        nq, nkv = spec.num_attention_heads, spec.num_key_value_heads

        def w(*shape, std=spec.init_std):
            return (torch.randn(*shape, generator=g) * std).to(device=self.device, dtype=dtype)

        def gain(n):
            return (1.0 + 0.1 * torch.randn(n, generator=g)).to(device=self.device, dtype=dtype)

        self.embed = w(spec.vocab_size, h, std=1.0)
        self.layers = [
            dict(
                input_norm=gain(h),
                q=w(nq * d, h),
                k=w(nkv * d, h),
                v=w(nkv * d, h),
                o=w(h, nq * d),
                q_norm=gain(d),
                k_norm=gain(d),
                post_norm=gain(h),
                gate=w(i, h),
                up=w(i, h),
                down=w(h, i),
            )
            for _ in range(self.num_layers)
        ]
        self.norm = gain(h)
        self.lm_head = w(spec.vocab_size, h)

    # ------------------------------------------------------------------ one decoder layer, two op orders
    def attention_inputs(self, lw: dict, a: torch.Tensor, cos, sin, fused: bool):
        """``q, k, v`` (``[N, heads, D]``) of the normalised input ``a [N, H]``."""
        o, s = self.ops, self.spec
        n = a.shape[0]
        q = o["linear"](a, lw["q"]).view(n, s.num_attention_heads, s.head_dim)
        k = o["linear"](a, lw["k"]).view(n, s.num_key_value_heads, s.head_dim)
        v = o["linear"](a, lw["v"]).view(n, s.num_key_value_heads, s.head_dim)
        if s.qk_norm and fused:
            return (
                o["rms_norm_rope"](q, lw["q_norm"], s.rms_norm_eps, cos, sin),
                o["rms_norm_rope"](k, lw["k_norm"], s.rms_norm_eps, cos, sin),
                v,
            )
        if s.qk_norm:
            q, k = o["rms_norm"](q, lw["q_norm"], s.rms_norm_eps), o["rms_norm"](k, lw["k_norm"], s.rms_norm_eps)
        return o["apply_rope"](q, cos, sin), o["apply_rope"](k, cos, sin), v

    def mlp(self, lw: dict, f: torch.Tensor) -> torch.Tensor:
        o = self.ops
        return o["linear"](o["silu_and_mul"](o["linear"](f, lw["gate"]), o["linear"](f, lw["up"])), lw["down"])

    def dense_layer(self, lw: dict, h: torch.Tensor, cos, sin) -> torch.Tensor:
        """TorchTitan's order on ``h [B, T, H]``: ``h = h + attn(norm(h))``; ``h = h + mlp(norm(h))``."""
        o, s = self.ops, self.spec
        b, t, _ = h.shape
        a = o["rms_norm"](h, lw["input_norm"], s.rms_norm_eps).reshape(b * t, -1)
        q, k, v = self.attention_inputs(lw, a, cos, sin, fused=False)
        attn = o["dense_causal_attention"](
            q.view(b, t, *q.shape[1:]), k.view(b, t, *k.shape[1:]), v.view(b, t, *v.shape[1:]), s.head_dim**-0.5
        )
        h = h + o["linear"](attn.reshape(b, t, -1), lw["o"])
        return h + self.mlp(lw, o["rms_norm"](h, lw["post_norm"], s.rms_norm_eps))

    def trainer_hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states ``[B, T, H]`` of right-padded ``tokens [B, T]`` (dense path)."""
        b, t = tokens.shape
        h = self.embed[tokens]
        pos = torch.arange(t, device=self.device).repeat(b)
        cos, sin = self.ops["rope_cos_sin"](pos, self.spec.head_dim, self.spec.rope_theta)
        for lw in self.layers:
            h = self.dense_layer(lw, h, cos, sin)
        return self.ops["rms_norm"](h, self.norm, self.spec.rms_norm_eps)

    def trainer_logprobs(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Per sequence, float32 ``[len - 1]``: log-prob of token ``i + 1`` given ``0..i`` (dense, one batch)."""
        t = max(len(s) for s in seqs)
        tokens = torch.zeros(len(seqs), t, dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = torch.tensor(s, device=self.device)
        h = self.trainer_hidden(tokens)
        out = []
        for i, s in enumerate(seqs):
            logits = self.ops["linear"](h[i, : len(s) - 1], self.lm_head)
            out.append(self.ops["selected_logprobs"](logits, tokens[i, 1 : len(s)]))
        return out

    # ------------------------------------------------------------------ serving path
    def paged_forward(
        self,
        tokens,
        positions,
        query_start_loc,
        seq_lens,
        block_table,
        slot_mapping,
        kv_caches,
        max_query_len: int,
        max_seq_len: int,
    ) -> torch.Tensor:
        """vLLM's order on a flattened batch: returns the final-normed hidden states ``[N, H]``."""
        o, s = self.ops, self.spec
        h = self.embed[tokens]
        cos, sin = o["rope_cos_sin"](positions, s.head_dim, s.rope_theta)
        delta = None
        for lw, kv in zip(self.layers, kv_caches, strict=True):
            if delta is None:
                a = o["rms_norm"](h, lw["input_norm"], s.rms_norm_eps)
            else:
                h, a = o["add_rms_norm"](h, delta, lw["input_norm"], s.rms_norm_eps)
            q, k, v = self.attention_inputs(lw, a, cos, sin, fused=True)
            key_cache, value_cache = kv.split(s.head_dim, dim=-1)
            bs = key_cache.shape[2]
            key_cache[slot_mapping // bs, :, slot_mapping % bs] = k
            value_cache[slot_mapping // bs, :, slot_mapping % bs] = v
            attn = o["paged_causal_attention"](
                q,
                key_cache,
                value_cache,
                query_start_loc,
                seq_lens,
                block_table,
                s.head_dim**-0.5,
                max_query_len,
                max_seq_len,
            )
            h, f = o["add_rms_norm"](
                h, o["linear"](attn.reshape(h.shape[0], -1), lw["o"]), lw["post_norm"], s.rms_norm_eps
            )
            delta = self.mlp(lw, f)
        return o["add_rms_norm"](h, delta, self.norm, s.rms_norm_eps)[1]


@dataclass
class RolloutResult:
    """Per request: the full token sequence (prompt + generated), the engine's log-prob of each generated token
    (float32), and statistics of the schedule (steps, decode tokens co-batched with prefill chunks)."""

    sequences: list[list[int]]
    logprobs: list[torch.Tensor]
    steps: int
    mixed_steps: int


def rollout(
    model: OpModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    token_budget: int = 64,
    block_size: int = 16,
    arrivals: list[int] | None = None,
    temperature: float = 0.0,
    seeds: list[int] | None = None,
    shuffle_seed: int = 0,
) -> RolloutResult:
    """Serve ``prompts`` with continuous batching; see the module docstring.

    Args:
        model: the model; prompts: token ids; max_new_tokens: tokens generated per request.
        token_budget: tokens per step (decodes first, then prefill chunks, vLLM's scheduler order).
        block_size: KV block size (any; vLLM's CUDA default is 16).
        arrivals: step at which each request arrives (default all at 0).
        temperature: 0 = greedy; else :func:`shared_numerics.sampling.sample_tokens` with ``seeds``.
        shuffle_seed: order in which free blocks are handed out.

    Returns:
        :class:`RolloutResult`.
    """
    s, dev = model.spec, model.device
    arrivals = arrivals or [0] * len(prompts)
    seeds = seeds or list(range(len(prompts)))
    total = sum(len(p) + max_new_tokens for p in prompts)
    num_blocks = total // block_size + 2 * len(prompts) + 4
    free = list(range(num_blocks))
    random.Random(shuffle_seed).shuffle(free)
    kv_caches = [
        torch.zeros(num_blocks, s.num_key_value_heads, block_size, 2 * s.head_dim, dtype=model.dtype, device=dev)
        for _ in range(model.num_layers)
    ]
    seqs = [list(p) for p in prompts]
    done = [0] * len(prompts)  # tokens whose KV is in the cache
    blocks: list[list[int]] = [[] for _ in prompts]
    logps: list[list[torch.Tensor]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    step = mixed = 0
    while not all(finished):
        running = [r for r in range(len(prompts)) if not finished[r] and arrivals[r] <= step]
        decodes = [r for r in running if done[r] == len(seqs[r]) - 1 and done[r] >= len(prompts[r])]
        prefills = [r for r in running if r not in decodes]
        budget, batch = token_budget, []
        for r in decodes + prefills:
            n = min(len(seqs[r]) - done[r], budget)
            if n > 0:
                batch.append((r, n))
                budget -= n
        step += 1
        if not batch:
            continue
        mixed += any(r in decodes for r, _ in batch) and any(r in prefills for r, _ in batch)
        toks, pos, slots, qsl, lens = [], [], [], [0], []
        for r, n in batch:
            need = -(-(done[r] + n) // block_size) - len(blocks[r])
            blocks[r] += [free.pop() for _ in range(need)]
            for p in range(done[r], done[r] + n):
                toks.append(seqs[r][p])
                pos.append(p)
                slots.append(blocks[r][p // block_size] * block_size + p % block_size)
            qsl.append(qsl[-1] + n)
            lens.append(done[r] + n)
        width = max(len(blocks[r]) for r, _ in batch)
        table = torch.tensor([blocks[r] + [0] * (width - len(blocks[r])) for r, _ in batch], dtype=torch.int32)

        def t(x, dtype=torch.int64):
            return torch.tensor(x, dtype=dtype, device=dev)

        hid = model.paged_forward(
            t(toks),
            t(pos),
            t(qsl, torch.int32),
            t(lens, torch.int32),
            table.to(dev),
            t(slots),
            kv_caches,
            max(n for _, n in batch),
            max(lens),
        )
        last = t([q - 1 for q in qsl[1:]])
        logits = model.ops["linear"](hid[last], model.lm_head)
        lps = model.ops["log_softmax"](logits)
        for i, (r, n) in enumerate(batch):
            done[r] += n
            if done[r] < len(seqs[r]):
                continue  # a prefill chunk that did not reach the end of the prompt
            if temperature > 0:
                tok = int(
                    sampling.sample_tokens(
                        logits[i : i + 1],
                        torch.tensor([temperature], device=dev),
                        torch.tensor([seeds[r]]),
                        torch.tensor([len(seqs[r]) - len(prompts[r])]),
                    )[0]
                )
            else:
                tok = int(torch.argmax(lps[i]))
            logps[r].append(lps[i, tok].reshape(1))
            seqs[r].append(tok)
            if len(seqs[r]) - len(prompts[r]) == max_new_tokens:
                finished[r] = True
                free += blocks[r]
                blocks[r] = []
    return RolloutResult(seqs, [torch.cat(x).float() for x in logps], step, mixed)


def stock_layer(model: OpModel, lw: dict, h: torch.Tensor, cos, sin) -> torch.Tensor:
    """The same decoder layer on stock PyTorch (cuBLAS ``F.linear``, ``F.rms_norm``, SDPA/FlashAttention): the
    benchmark's baseline. ``h [B, T, H]``."""
    stock = OpModel.__new__(OpModel)
    stock.__dict__.update(model.__dict__)
    stock.ops = STOCK_OPS
    return stock.dense_layer(lw, h, cos, sin)
