"""Extension points: a third-party plugin package, discovered through the ``zerokld`` entry-point group, adds a loss
and a delta codec that are then used end to end (a TorchTitan training step; a snapshot round trip)."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zerokld_plugins as zp
from shared_numerics.rollout import RolloutBatch

PLUGIN = textwrap.dedent("""
    import lzma

    import numpy as np
    from pydantic import BaseModel

    from zerokld_plugins import CodecSpec, LossSpec, hookimpl


    class ScaledPGConfig(BaseModel):
        scale: float = 1.0


    def scaled_pg(logp, sampler_logp, adv, cfg, batch=None):
        return -cfg.scale * adv * logp, {}


    def _xor(a, b):
        return np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)).tobytes()


    def encode(base, new):
        return lzma.compress(_xor(base, new))


    def decode(base, payload):
        return _xor(base, lzma.decompress(payload))


    @hookimpl
    def zerokld_losses():
        return [LossSpec("scaled_pg", scaled_pg, ScaledPGConfig, "-scale*A*l")]


    @hookimpl
    def zerokld_delta_codecs():
        return [CodecSpec("xor_lzma", encode, decode, "XOR + lzma")]
""")

DUPLICATE = textwrap.dedent("""
    from zerokld_plugins import LossSpec, hookimpl


    @hookimpl
    def zerokld_losses():
        return [LossSpec("ppo", lambda *a: None, "shared_numerics.losses:NoConfig")]
""")


def _install(site, dist: str, module: str, source: str) -> None:
    (site / f"{module}.py").write_text(source)
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[zerokld]\n{dist} = {module}\n")


def _activate(site) -> None:
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    zp.reset_plugin_manager()


def _deactivate(site, module: str) -> None:
    if str(site) in sys.path:
        sys.path.remove(str(site))
    sys.modules.pop(module, None)
    importlib.invalidate_caches()
    zp.reset_plugin_manager()


@pytest.fixture
def plugin_site(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    _install(site, "zk-demo-plugin", "zk_demo_plugin", PLUGIN)
    _activate(site)
    yield site
    _deactivate(site, "zk_demo_plugin")


def test_builtins_are_registered_through_the_hooks():
    """Each of zerokld's packages registers its own built-ins through the same entry-point group as any plugin."""
    zp.reset_plugin_manager()
    names = {(r.kind, r.name): r.provider for r in zp.list_registrations()}
    expected = {
        ("loss", "ppo"): "shared_numerics",
        ("loss", "cross_entropy"): "shared_numerics",
        ("loss", "importance_sampling"): "shared_numerics",
        ("backend", "torch"): "shared_numerics",
        ("backend", "triton"): "shared_numerics",
        ("backend", "cublas"): "shared_numerics",
        ("codec", "arc_v2"): "deltasync",
        ("storage", "file"): "deltasync",
        ("storage", "memory"): "deltasync",
        ("model", "Qwen3ForCausalLM"): "zerokld_models",
        ("model", "LlamaForCausalLM"): "zerokld_models",
        ("model", "Qwen3MoeForCausalLM"): "zerokld_models",
        ("model", "Qwen2ForCausalLM"): "zerokld_models",
    }
    assert {k: names.get(k) for k in expected} == expected
    import zerokld_plugins

    assert sorted(p.name for p in Path(zerokld_plugins.__file__).parent.glob("*.py")) == [
        "__init__.py",
        "__main__.py",
        "envs.py",
        "errors.py",
        "hookspecs.py",
        "manager.py",
        "specs.py",
    ]  # no built-ins of its own (envs and errors: the shared variables and error base, no registrations)


def test_third_party_plugin_discovered_and_removable(plugin_site):
    regs = {(r.kind, r.name): r.provider for r in zp.list_registrations()}
    assert regs[("loss", "scaled_pg")] == "zk-demo-plugin"
    assert regs[("codec", "xor_lzma")] == "zk-demo-plugin"
    # removing the plugin makes its names unknown, with an error that lists what is registered
    _deactivate(plugin_site, "zk_demo_plugin")
    with pytest.raises(zp.UnknownNameError, match="unknown loss 'scaled_pg'.*ppo"):
        zp.get_loss("scaled_pg")
    with pytest.raises(zp.UnknownNameError, match="unknown codec 'xor_lzma'.*arc_v2"):
        zp.get_codec("xor_lzma")


def test_duplicate_name_names_both_providers(tmp_path):
    site = tmp_path / "dup"
    site.mkdir()
    _install(site, "zk-dup-plugin", "zk_dup_plugin", DUPLICATE)
    _activate(site)
    try:
        with pytest.raises(zp.DuplicateNameError, match="loss 'ppo'.*'shared_numerics'.*'zk-dup-plugin'"):
            zp.get_loss("ppo")
    finally:
        _deactivate(site, "zk_dup_plugin")


@pytest.mark.parametrize("codec", ["xor_lzma", "arc_v2"])
def test_codec_snapshot_round_trip(plugin_site, checkpoint_factory, tmp_path, codec):
    from deltasync import apply_incremental_snapshot, read_snapshot_tensors, write_incremental_snapshot

    base = checkpoint_factory("qwen3", "bfloat16")
    old = read_snapshot_tensors(base)
    g = torch.Generator().manual_seed(0)
    new = {}
    for k, v in old.items():  # an RL-step-like change: a few elements move
        n = v.clone()
        flat = n.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        flat[idx] = (flat[idx].float() + 0.01).to(n.dtype)
        new[k] = n
    delta = write_incremental_snapshot(base, new, tmp_path / "delta", compression_format=codec)
    out = apply_incremental_snapshot(base, delta, tmp_path / "applied")
    got = read_snapshot_tensors(out)
    assert got.keys() == new.keys() and all(torch.equal(got[k], new[k]) for k in new)


@pytest.mark.titan
def test_plugin_loss_in_a_training_step(plugin_site, checkpoint_factory, tmp_path):
    from titan_plugin import trainer_logprobs
    from titan_plugin.rl import RLTrainer, rl_trainer_config

    ckpt = checkpoint_factory("qwen3", "float32")
    trainer = RLTrainer(
        rl_trainer_config(
            ckpt, str(tmp_path / "dump"), dtype="float32", lr=1e-3, loss_fn="scaled_pg", loss_fn_config={"scale": 2.0}
        )
    )
    try:
        seqs = [[1, 5, 6, 7, 8, 9, 10], [1, 11, 12, 13, 14]]
        plens, adv = [3, 2], [1.0, -0.5]
        ref = trainer_logprobs(ckpt, seqs, plens, dtype="float32")
        out = trainer.rl_step(RolloutBatch(seqs, plens, adv, [r.clone() for r in ref], numerics=trainer.numerics))
        expected = sum((-2.0 * a * r).sum().item() for a, r in zip(adv, ref, strict=True)) / sum(r.numel() for r in ref)
        assert out["loss"] == pytest.approx(expected, rel=1e-5)
        after = trainer_logprobs(str(trainer.save_hf(tmp_path / "s1", "float32")), seqs, plens, dtype="float32")
        assert any(not torch.equal(a, b) for a, b in zip(after, ref, strict=True))
    finally:
        trainer.close()
    _deactivate(plugin_site, "zk_demo_plugin")  # without the plugin the loss name is refused when the loss is built
    with pytest.raises(zp.UnknownNameError, match="unknown loss 'scaled_pg'"):
        rl_trainer_config(ckpt, str(tmp_path / "dump2"), loss_fn="scaled_pg").loss.build()


def test_storage_registry_round_trip():
    from deltasync.storage import filesystem_for

    fs = filesystem_for("memory://zk/test.bin")
    with fs.open("memory://zk/test.bin", "wb") as f:
        f.write(b"abc")
    assert fs.cat("memory://zk/test.bin") == b"abc"
    with pytest.raises(zp.UnknownNameError, match="unknown storage 'gopher'"):
        filesystem_for("gopher://x/y")
