"""tinker 0.38's sampling sessions (issue 38), with the official client, unmodified (``tinker==0.38.0``): the training
server saves a snapshot and loads it into a real ``vllm serve`` with zerokld's hot-load API
(``save_weights_and_get_sampling_client``, ``create_sampling_client``), ``sample`` and ``compute_logprobs`` go through
``asample`` to that engine, and the sampled tokens' log-probs are the trainer's ``forward`` log-probs bit for bit —
for a LoRA model (its adapter, a vLLM LoRA) and a full-parameter one (``rank=0``: the engine's weights, a delta after
the first snapshot) — at every step of a short RL loop (``importance_sampling`` on the samples, ``optim_step``).
Negative controls: after a step the samples' log-probs differ from the base model's (the new snapshot serves);
a session whose snapshot a later save replaced is refused, never answered by other weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.servers.test_tinker_wire import _datum
from titan_plugin import trainer_logprobs
from vllm_plugin.serve import HotLoadServer

pytestmark = [pytest.mark.vllm, pytest.mark.titan]

API_KEY = "tml-zerokld-sampling"
MAX_RANK = 8
PROMPT = [1] + list(range(10, 40))


@pytest.fixture(scope="module")
def servers(engine_slot, checkpoint_factory, tmp_path_factory):
    """One ``vllm serve`` (LoRA on, hot-load on the snapshot root) and the training server sampling through it."""
    from titan_plugin.training_server import TrainingServerProcess

    engine_slot.close()
    ckpt = checkpoint_factory("qwen3", "bfloat16")
    tmp = tmp_path_factory.mktemp("tinker_sampling")
    (tmp / "snapshots").mkdir()
    vllm = HotLoadServer(
        ckpt,
        tmp / "snapshots",
        tmp / "state",
        tmp / "server.log",
        API_KEY,
        ("--enable-lora", "--max-loras", "2", "--max-lora-rank", str(MAX_RANK)),
    )
    vllm.start()
    try:
        trainer = TrainingServerProcess(
            ckpt,
            tmp / "snapshots",
            API_KEY,
            tmp / "trainer.log",
            ["--max-lora-rank", MAX_RANK, "--sampler-url", vllm.base],
        )
        trainer.start()
        try:
            yield trainer.base, ckpt, tmp / "snapshots"
        finally:
            trainer.stop()
    finally:
        vllm.stop()


def _training_client(servers, monkeypatch, request, rank: int):
    """``(service client, training client of rank ``rank``, checkpoint, snapshot root)``; the session closes with the
    test."""
    import tinker

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    url, ckpt, snapshots = servers
    svc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    request.addfinalizer(lambda: svc.close("success"))
    return svc, svc.create_lora_training_client(base_model=ckpt, rank=rank).result(), ckpt, snapshots


def _rl_steps(tc, ckpt: str, steps: int = 2) -> list:
    """``steps`` RL steps through the client: save + sampling client, 2 samples, the trainer's forward on them (equal
    to the sampled log-probs bit for bit, and the prompt's log-probs of ``compute_logprobs`` too), importance sampling,
    optim_step. Returns the sampling clients, oldest first."""
    from tinker import types

    clients, moved = [], False
    for step in range(steps):
        sc = tc.save_weights_and_get_sampling_client().result()
        clients.append(sc)
        res = sc.sample(
            types.ModelInput.from_ints(PROMPT),
            num_samples=2,
            sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=100 + step),
        ).result()
        assert len(res.sequences) == 2 and all(s.sequence_id for s in res.sequences)
        full = [PROMPT + list(s.tokens) for s in res.sequences]
        sampled = [torch.tensor(np.asarray(s.logprobs), dtype=torch.float32) for s in res.sequences]
        data = [_datum(f, len(PROMPT)) for f in full]
        fwd = tc.forward(data, "cross_entropy").result()
        train = [torch.tensor(np.asarray(o["logprobs"].data), dtype=torch.float32) for o in fwd.loss_fn_outputs]
        assert [t[len(PROMPT) - 1 :].shape for t in train] == [s.shape for s in sampled]
        assert all(torch.equal(t[len(PROMPT) - 1 :], s) for t, s in zip(train, sampled, strict=True)), step  # KL = 0
        prompt_lps = sc.compute_logprobs(types.ModelInput.from_ints(full[0])).result()
        assert len(prompt_lps) == len(full[0]) and prompt_lps[0] is None
        assert torch.equal(torch.tensor(prompt_lps[1:], dtype=torch.float32), train[0]), step
        base = trainer_logprobs(ckpt, full, [len(PROMPT)] * 2, dtype="bfloat16")
        moved |= not all(torch.equal(b, s) for b, s in zip(base, sampled, strict=True))
        rl = [
            _datum(
                f,
                len(PROMPT),
                {
                    "advantages": [0.0] * (len(PROMPT) - 1) + [1.0 - i] * len(s),
                    "logprobs": [0.0] * (len(PROMPT) - 1) + s.tolist(),
                },
            )
            for i, (f, s) in enumerate(zip(full, sampled, strict=True))
        ]
        out = tc.forward_backward(rl, "importance_sampling").result()
        assert out.metrics and all(k.count(":") == 1 for k in out.metrics)
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert moved  # negative control: what samples is the trained snapshot, not the base model
    return clients


def _refused_when_replaced(old, new):
    """A session whose snapshot a later save replaced is refused at submit (400: the client raises), the newest
    samples."""
    import tinker
    from tinker import types

    params = types.SamplingParams(max_tokens=2, temperature=1.0, seed=1)
    with pytest.raises(tinker.BadRequestError, match="no longer serve"):
        old.sample(types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=params).result()
    assert len(new.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences) == 1


def test_lora_sampling_sessions_sample_the_trainers_adapter_bitwise(servers, monkeypatch, request):
    """A LoRA model: each save is a version of its vLLM adapter; the samples' log-probs are the trainer's. Also:
    ``create_sampling_client(model_path)`` on a named save, ``GET samplers/{id}``, refusals of what is not served."""
    import tinker
    from tinker import types

    svc, tc, ckpt, _ = _training_client(servers, monkeypatch, request, rank=4)
    clients = _rl_steps(tc, ckpt)
    _refused_when_replaced(clients[0], clients[-1])

    path = tc.save_weights_for_sampler("lora-named").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/lora-named"
    named = svc.create_sampling_client(model_path=path).result()
    assert named.get_base_model() == ckpt  # GET samplers/{id}
    res = named.sample(
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=4, temperature=1.0, seed=7)
    ).result()
    full = PROMPT + list(res.sequences[0].tokens)
    fwd = tc.forward([_datum(full, len(PROMPT))], "cross_entropy").result()
    assert torch.equal(
        torch.tensor(np.asarray(fwd.loss_fn_outputs[0]["logprobs"].data), dtype=torch.float32)[len(PROMPT) - 1 :],
        torch.tensor(np.asarray(res.sequences[0].logprobs), dtype=torch.float32),
    )
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs"):
        named.sample(
            types.ModelInput.from_ints(PROMPT),
            1,
            types.SamplingParams(max_tokens=2),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=3,
        ).result()
    with pytest.raises(tinker.BadRequestError, match="no sampler snapshot"):
        svc.create_sampling_client(model_path=f"tinker://{tc.model_id}/sampler_weights/never-saved").result()


def test_full_parameter_sampling_sessions_sample_the_trainers_weights_bitwise(servers, monkeypatch, request):
    """``rank=0`` (full-parameter): each ``save_weights_and_get_sampling_client`` loads the model's next snapshot as
    the engine's weights — the second one a delta against the first — and the samples' log-probs are the trainer's."""
    _, tc, ckpt, snapshots = _training_client(servers, monkeypatch, request, rank=0)
    clients = _rl_steps(tc, ckpt)
    _refused_when_replaced(clients[0], clients[-1])
    assert (snapshots / f"{tc.model_id}-1" / "config.json").is_file()  # full, then a delta against it
    assert (snapshots / f"{tc.model_id}-2" / "delta.json").is_file()
