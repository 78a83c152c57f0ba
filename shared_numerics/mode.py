"""The numerics contract between the trainer and the rollout engine: :class:`NumericsMode`.

Log-probs are bitwise equal across the two sides only if both run the same op table (backend), in the same dtype,
with the same FP8 granularity and the same fixed constants (GEMM kernels, the pinned oneDNN call shape and thread
count of CPUs without FMA units, attention chunk sizes, the Triton
attention's key split). One object says all of that; both sides build theirs from their own configuration
(vLLM: :func:`vllm_plugin.config.numerics_mode` of ``additional_config["zerokld"]``; TorchTitan:
:func:`titan_plugin.rl.numerics_mode` of the ``Trainer.Config``) and it travels with the data:

* stamped into every snapshot's spec (``model.weight.spec.json`` / ``delta.json`` key ``"numerics"``) and checked
  by the replica before a snapshot is loaded (:class:`deltasync.Replica`);
* stamped into every rollout (``CompletionOutput.zerokld_numerics``, the ``zerokld_numerics`` field of each OpenAI
  ``/v1/completions`` choice) and checked when the trainer consumes the rollouts
  (:class:`shared_numerics.rollout.RolloutBatch`).

A mismatch raises :class:`NumericsMismatchError` naming both modes, before anything is computed or loaded.

The switch itself has one name everywhere: ``batch_invariant`` (vLLM's own term for this mode, ``VLLM_BATCH_INVARIANT``;
``additional_config={"zerokld": {"batch_invariant": true}}`` on the engine, ``batch_invariant=True`` on the trainer).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any

from zerokld_plugins.errors import ZeroKLDClientError

from .attention import KEY_CHUNK, Q_TILE, SPLIT
from .gemm_cublas import CUBLAS_ROWS
from .linear import ROW_TILE, gemm_partition

__all__ = [
    "contract",
    "DTYPES",
    "FP8_GRANULARITIES",
    "NumericsMismatchError",
    "NumericsMode",
    "backend_for_device",
    "check_same_numerics",
]


#: Version of the fixed constants both sides must share; bump the leading number when a kernel's arithmetic order
#: changes without a constant changing.
#: 5: the Triton bf16/fp16 GEMM tile 128x128x64 -> 128x256x64; the cublas backend's row block
#: 6: Triton attention forward: the softmax scale applied in an fma (``exp2(fma(s, scale, -m))``), no FP contraction
@functools.lru_cache(maxsize=1)
def contract() -> str:
    """This process's numerics contract string: the fixed constants (above) and
    :func:`shared_numerics.linear.gemm_partition` (the GEMM paths this machine takes). Computed on first call, not at
    import (it builds the GEMM kernel: reading a snapshot needs no compiler)."""
    return (
        f"6:row_tile={ROW_TILE},gemm={gemm_partition()},key_chunk={KEY_CHUNK},q_tile={Q_TILE},split={SPLIT},"
        f"cublas_rows={CUBLAS_ROWS}"
    )


DTYPES = ("float32", "bfloat16", "float16")
FP8_GRANULARITIES = ("per_channel", "block")


class NumericsMismatchError(ZeroKLDClientError, ValueError):
    """Trainer and rollout engine (or a snapshot) were produced under different :class:`NumericsMode` s (HTTP 422)."""

    status_code = 422


def backend_for_device(device_type: str) -> str:
    """The numerics backend a process uses on ``device_type`` (``"cpu"``, ``"cuda"``): ``ZEROKLD_BACKEND`` if set,
    else ``triton`` on CUDA, else ``torch`` — the same rule the op dispatch applies per call
    (:func:`shared_numerics.backend_name`)."""
    from zerokld_plugins import envs

    forced = envs.ZEROKLD_BACKEND
    if forced:
        return forced
    return "triton" if device_type == "cuda" else "torch"


@dataclass(frozen=True)
class NumericsMode:
    """What decides the bits of a log-prob.

    Attributes:
        batch_invariant: the zerokld numerics are on (``False``: stock vLLM / TorchTitan kernels; nothing below is
            then a guarantee, and two stock modes never compare equal).
        backend: op table name (``"torch"``, ``"triton"``, ``"cublas"``, or a plugin's), ``None`` when off.
        dtype: activation/parameter dtype of the forward: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        fp8: FP8 granularity of the decoder projections (``"per_channel"``, ``"block"``) or ``None``.
        contract: :func:`contract` of the process that built the mode.
        tp_k_block: ``None``: row-parallel projections are one fused GEMM (TP 1 only). An int: ``o_proj`` /
            ``down_proj`` sum over ``K`` in fixed blocks of this many columns with the TP-aligned tree of
            :mod:`shared_numerics.tensor_parallel`, and log-probs come from the vocab-parallel log-softmax of
            :mod:`shared_numerics.vocab_parallel` (an exact sum over the vocabulary): the same bits at TP 1, 2, 4,
            ... (it changes the TP 1 bits too, so both sides must name the same value).

    Raises (constructor):
        ValueError: unknown dtype or FP8 granularity; ``tp_k_block`` not a positive int.
    """

    batch_invariant: bool
    backend: str | None
    dtype: str
    fp8: str | None = None
    contract: str = field(default_factory=contract)
    tp_k_block: int | None = None

    def __post_init__(self) -> None:
        if self.tp_k_block is not None and (not isinstance(self.tp_k_block, int) or self.tp_k_block <= 0):
            raise ValueError(f"NumericsMode tp_k_block {self.tp_k_block!r} is not a positive int")
        if self.dtype not in DTYPES:
            raise ValueError(f"NumericsMode dtype {self.dtype!r} not in {DTYPES}")
        if self.fp8 is not None and self.fp8 not in FP8_GRANULARITIES:
            raise ValueError(f"NumericsMode fp8 {self.fp8!r} not in {FP8_GRANULARITIES}")

    @classmethod
    def build(
        cls,
        batch_invariant: bool,
        dtype: str,
        fp8: str | None = None,
        device_type: str = "cpu",
        tp_k_block: int | None = None,
    ) -> NumericsMode:
        """The mode of a process running on ``device_type`` (backend from :func:`backend_for_device`)."""
        return cls(
            bool(batch_invariant),
            backend_for_device(device_type) if batch_invariant else None,
            str(dtype).removeprefix("torch."),
            fp8 if batch_invariant else None,
            contract() if batch_invariant else "",
            tp_k_block if batch_invariant else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the one stamped into snapshot specs and rollout responses)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NumericsMode:
        """Inverse of :meth:`to_dict`. Raises ValueError on a malformed dict."""
        try:
            return cls(
                bool(d["batch_invariant"]),
                d.get("backend"),
                d["dtype"],
                d.get("fp8"),
                d.get("contract", ""),
                d.get("tp_k_block"),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed numerics mode {d!r}: {e}") from e

    def __str__(self) -> str:
        if not self.batch_invariant:
            return f"stock {self.dtype} (batch_invariant off)"
        return (
            f"batch_invariant backend={self.backend} dtype={self.dtype} fp8={self.fp8 or 'off'} "
            f"contract={self.contract}" + (f" tp_k_block={self.tp_k_block}" if self.tp_k_block else "")
        )

    def matches(self, other: NumericsMode) -> bool:
        """Whether the two sides compute the same bits: both on and every field equal."""
        return self.batch_invariant and other.batch_invariant and self == other


def check_same_numerics(
    ours: NumericsMode, theirs: NumericsMode | dict | None, ours_name: str, theirs_name: str
) -> None:
    """Raise :class:`NumericsMismatchError` unless ``theirs`` (a mode, its dict, or ``None`` = not stamped) is
    ``ours`` with ``batch_invariant`` on. The message names both modes and, per differing setting, both values (e.g.
    ``fp8: engine 'block', snapshot None``).

    A stock ``ours`` accepts anything (nothing is promised without the zerokld numerics)."""
    if not ours.batch_invariant:
        return
    if theirs is None:
        raise NumericsMismatchError(
            f"{ours_name} runs {ours}, but the {theirs_name} carries no numerics mode "
            "(produced without zerokld batch_invariant)"
        )
    if isinstance(theirs, dict):
        theirs = NumericsMode.from_dict(theirs)
    if not ours.matches(theirs):
        mine, other = ours.to_dict(), theirs.to_dict()
        differ = "; ".join(
            f"{k}: {ours_name} {mine[k]!r}, {theirs_name} {other[k]!r}" for k in mine if mine[k] != other[k]
        )
        raise NumericsMismatchError(
            f"numerics mismatch: {ours_name} runs {ours}; {theirs_name} was produced with {theirs} ({differ})"
        )
