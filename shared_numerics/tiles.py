"""The fixed tile shapes of zerokld's attention order (:mod:`shared_numerics.attention`), shared by its reference
definition and the CPU kernels (:mod:`shared_numerics.attention_cpu`): part of the numerics contract."""

__all__ = ["KEY_CHUNK", "Q_TILE"]

#: keys per chunk of the online-softmax sum (absolute positions, chunk 0 first)
KEY_CHUNK = 32
#: consecutive queries of one sequence per tile of the batched q·k and p·v products
Q_TILE = 16
