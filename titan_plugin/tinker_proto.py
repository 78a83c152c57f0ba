"""tinker 0.38's protobuf training wire, as the training server speaks it (``docs/wire.md``
§4): ``POST /api/v1/forward_backward`` bodies arrive as ``tinker_public.ForwardBackwardRequest`` (``Content-Type:
application/x-protobuf``, zstd-compressed when ``Content-Encoding: zstd``), and their results go back as
``tinker_public.ForwardBackwardOutput``. This module only converts: a request becomes the JSON body the Fireworks
spelling of the same call has (:mod:`titan_plugin.training_server` then runs one code path for both), a result the
protobuf the client decodes.

* request: ``model_input`` chunks -> ``{"type": "encoded_text", "tokens"}`` (int32 little-endian bytes; image and
  audio chunks are refused), ``loss_fn_inputs`` tensors -> TensorData ``{"data", "dtype", "shape"}`` (dense float32 /
  int64 / int32 / bf16; sparse CSR is refused: its missing entries take a pad value the wire does not carry),
  ``loss_fn_config_v2`` (numbers and strings) over the legacy ``loss_fn_config``; ``forward_only`` -> a ``forward``
  call (``forward_input``).
* sampling (:mod:`titan_plugin.tinker_sampler`): ``SampleResponse`` — per sequence int32 tokens, float32 log-probs
  and the stop reason; the prompt's float32 log-probs (``NaN`` where none exists) when asked for.
* result: one ``ArrayRecord`` whose fields hold every datum's outputs back to back (``offsets``: byte offsets, one
  more than the datums), ``metrics`` as given.

The schema is tinker's own (``tinker.proto.tinker_public_pb2``, shipped in the ``tinker`` wheel): a server without the
``tinker`` package refuses protobuf bodies with a message that says so.

Source: ``tinker==0.38.0`` (``tinker/proto/request_conv.py``, ``response_conv.py``, ``resources/training.py``).
"""

from __future__ import annotations

import numpy as np

from zerokld_plugins.errors import ZeroKLDClientError

__all__ = [
    "CONTENT_TYPE",
    "BodyTooLarge",
    "TooManyTokens",
    "WireError",
    "decompress_zstd",
    "forward_backward_output",
    "forward_backward_request",
    "sample_response",
]

CONTENT_TYPE = "application/x-protobuf"


class WireError(ZeroKLDClientError, ValueError):
    """A protobuf body that cannot be read (the user's error)."""


class BodyTooLarge(WireError):
    """A body that decompresses to more than the limit (the user's error)."""


class TooManyTokens(WireError):
    """A request of more input tokens than the limit, each datum counting at least one (the user's error).

    Attributes:
        tokens: what it carries so counted. datums: how many datums.
    """

    def __init__(self, tokens: int, datums: int) -> None:
        super().__init__(f"{tokens} input tokens over {datums} datums")
        self.tokens, self.datums = tokens, datums


def decompress_zstd(body: bytes, limit: int) -> bytes:
    """``body`` (one or more zstd frames) decompressed as a stream that stops once more than ``limit`` bytes came out:
    memory stays within ``limit`` plus one 1 MiB read, whatever size the frame header claims (a zstd bomb costs the
    limit, not its claimed size).

    Raises:
        BodyTooLarge: more than ``limit`` bytes. WireError: not zstd.
    """
    import io

    import zstandard

    out, size = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True) as reader:
            while chunk := reader.read(1 << 20):
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"the zstd body decompresses to more than the limit of {limit} bytes")
                out.append(chunk)
    except zstandard.ZstdError as e:
        raise WireError(f"the zstd body does not decompress: {e}") from None
    return b"".join(out)


def _pb():
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError:  # pragma: no cover - the test extra installs tinker
        raise WireError("protobuf bodies need the tinker package on the server (pip install tinker==0.38.0)") from None
    return tinker_public_pb2


def _tensor(msg, name: str) -> dict:
    """A ``tinker_public.Tensor`` as TensorData JSON. Raises WireError."""
    pb = _pb()
    dtypes = {
        pb.DTYPE_FLOAT32: ("float32", np.float32),
        pb.DTYPE_INT64: ("int64", np.int64),
        pb.DTYPE_INT32: ("int64", np.int32),
        pb.DTYPE_BFLOAT16: ("float32", np.uint16),
    }
    if msg.dtype not in dtypes:
        raise WireError(f"loss_fn_inputs[{name!r}]: unknown dtype {msg.dtype}")
    label, np_dtype = dtypes[msg.dtype]
    shape = [int(s) for s in msg.shape]
    if msg.WhichOneof("encoding") == "sparse_csr":  # its other entries take a pad value the wire does not carry
        raise WireError(f"loss_fn_inputs[{name!r}]: sparse tensors are not served (send it dense)")
    try:
        arr = np.frombuffer(msg.dense, dtype=np_dtype)
    except ValueError as e:
        raise WireError(f"loss_fn_inputs[{name!r}]: {e}") from None
    if np_dtype == np.uint16:  # bf16: the upper half of a float32
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    if not shape:
        shape = [int(arr.size)]
    if int(np.prod(shape)) != arr.size:
        raise WireError(f"loss_fn_inputs[{name!r}]: {arr.size} values for shape {shape}")
    return {"data": arr.tolist(), "dtype": label, "shape": shape}


def forward_backward_request(
    body: bytes, content_encoding: str | None = None, max_bytes: int = 64 << 20, max_tokens: int | None = None
) -> dict:
    """A protobuf ``ForwardBackwardRequest`` body as the JSON body of the same call.

    Args:
        body: the HTTP body (bytes-like). content_encoding: its ``Content-Encoding`` (``zstd`` or none).
        max_bytes: the largest body accepted after decompression (:func:`decompress_zstd`).
        max_tokens: the most input tokens over all datums, each datum counting at least one, checked on the parsed
            message before any datum becomes Python objects (``None``: unchecked).

    Returns:
        ``{"model_id", "seq_id", "forward_only", "forward_input" | "forward_backward_input": {"data", "loss_fn",
        "loss_fn_config"}}`` with data as the JSON wire's datums (``model_input.chunks``, ``loss_fn_inputs``).

    Raises:
        BodyTooLarge: the decompressed body is over ``max_bytes``.
        TooManyTokens: more than ``max_tokens`` input tokens so counted.
        WireError: another encoding, a body that is not a ``ForwardBackwardRequest``, a chunk other than encoded
            text, a tensor that does not match its shape or dtype.
    """
    pb = _pb()
    if content_encoding not in (None, "", "identity", "zstd"):
        raise WireError(f"Content-Encoding {content_encoding[:20]!r} is not served (zstd or none)")
    if content_encoding == "zstd":
        body = decompress_zstd(body, max_bytes)
    elif len(body) > max_bytes:
        raise BodyTooLarge(f"the body is over the limit of {max_bytes} bytes")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise WireError(f"the body is not a tinker ForwardBackwardRequest: {type(e).__name__}") from None
    del body
    if max_tokens is not None:
        tokens = sum(max(1, sum(len(c.encoded_text.tokens) // 4 for c in d.model_input)) for d in msg.data)
        if tokens > max_tokens:
            raise TooManyTokens(tokens, len(msg.data))
    data = []
    for i, d in enumerate(msg.data):
        chunks = []
        for c in d.model_input:
            if c.WhichOneof("chunk") != "encoded_text":
                raise WireError(f"datum {i}: only encoded_text chunks are served, got {c.WhichOneof('chunk')}")
            raw = c.encoded_text.tokens
            if len(raw) % 4:
                raise WireError(f"datum {i}: encoded_text tokens are not int32 bytes")
            chunks.append({"type": "encoded_text", "tokens": np.frombuffer(raw, dtype="<i4").tolist()})
        data.append(
            {
                "model_input": {"chunks": chunks},
                "loss_fn_inputs": {k: _tensor(v, k) for k, v in d.loss_fn_inputs.items()},
            }
        )
    config: dict = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # v2 wins (numbers and strings)
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    spec = {"data": data, "loss_fn": msg.loss_fn, "loss_fn_config": config or None}
    return {
        "model_id": msg.model_id,
        "seq_id": int(msg.seq_id),
        "forward_only": bool(msg.forward_only),
        ("forward_input" if msg.forward_only else "forward_backward_input"): spec,
    }


def forward_backward_output(result: dict) -> bytes:
    """The JSON result of a ``forward`` / ``forward_backward`` (``loss_fn_output_type``, ``loss_fn_outputs``: per datum
    TensorData fields, ``metrics``) as protobuf ``ForwardBackwardOutput`` bytes: one ``ArrayRecord`` per call, each
    field a ``BatchedTensor`` of the datums' values back to back (float32 or int64; ``offsets`` in bytes)."""
    pb = _pb()
    out = pb.ForwardBackwardOutput()
    out.loss_fn_output_type = str(result.get("loss_fn_output_type") or "")
    for k, v in (result.get("metrics") or {}).items():
        out.metrics[k] = float(v)
    outputs = result.get("loss_fn_outputs") or []
    if outputs:
        record = out.loss_fn_outputs.add()
        record.num_datums = len(outputs)
        for name in outputs[0]:
            dtype = outputs[0][name].get("dtype", "float32")
            np_dtype, pb_dtype = (np.int64, pb.DTYPE_INT64) if dtype == "int64" else (np.float32, pb.DTYPE_FLOAT32)
            arrays = [np.asarray(o[name]["data"], dtype=np_dtype).reshape(-1) for o in outputs]
            field = record.fields[name]
            field.dtype = pb_dtype
            field.data = b"".join(a.tobytes() for a in arrays)
            field.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64).tobytes()
    return out.SerializeToString()


def sample_response(result: dict) -> bytes:
    """An ``asample`` result (``{"sequences": [{"tokens", "logprobs", "stop_reason": "stop" | "length"}],
    "prompt_logprobs": [float | None] | None}``) as protobuf ``SampleResponse`` bytes (tokens int32, log-probs
    float32, a missing prompt log-prob ``NaN``: tinker's ``response_conv`` reads it back as ``None``)."""
    pb = _pb()
    out = pb.SampleResponse()
    for s in result.get("sequences") or []:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_LENGTH if s.get("stop_reason") == "length" else pb.STOP_REASON_STOP
        seq.tokens = np.asarray(s["tokens"], dtype="<i4").tobytes()
        if s.get("logprobs") is not None:
            seq.logprobs = np.asarray(s["logprobs"], dtype="<f4").tobytes()
    prompt = result.get("prompt_logprobs")
    if prompt is not None:
        out.prompt_logprobs = np.asarray([np.nan if v is None else v for v in prompt], dtype="<f4").tobytes()
    return out.SerializeToString()
