"""Negative controls that depend on upstream behaviour (torch's / oneDNN's kernels, vLLM, TorchTitan, torchao).

Such a control shows that stock gives other bits where zerokld gives the same; whether stock differs depends on the
upstream version, the CPU's ISA and the shapes, not on zerokld. :func:`stock_differs` is the one place that checks it:
where stock happens to be invariant, the test fails as a setup error that says so and what to change — never a pass
that proves nothing.
"""

from __future__ import annotations

__all__ = ["StockInvariantHere", "stock_differs"]


class StockInvariantHere(AssertionError):
    """A negative control's precondition does not hold on this machine / version: stock gives the same bits here."""


def stock_differs(differs: bool, what: str, change: str) -> None:
    """Require the upstream behaviour a negative control relies on.

    Args:
        differs: whether stock gave other bits (the control's observation).
        what: the stock behaviour, e.g. ``"F.linear's row alone vs in a batch of 300 (bf16, K 1024-8192)"``.
        change: what to change in the test where this fails (shapes, loads, thread counts).

    Raises:
        StockInvariantHere: ``differs`` is false; the message names the machine (CPU model, ISA flags, torch).
    """
    if differs:
        return
    import torch

    from shared_numerics.machine import cpu_model, isa_flags

    raise StockInvariantHere(
        f"negative control's precondition: stock {what} happens to be invariant here "
        f"({cpu_model()}, ISA {'+'.join(isa_flags()) or 'none listed'}, torch {torch.__version__}"
        f"): the test proves nothing at this setup; change {change}"
    )
