"""One settings object on both sides (issue 39 point 2): :class:`shared_numerics.settings.ZeroKLDSettings` — vLLM's
``additional_config["zerokld"]`` and the trainer's ``RLTrainer.Config.zerokld`` are the same object type with the
same spelling and defaults, the rules on which settings combine are enforced once, and a mode mismatch names each
differing setting with both values."""

from __future__ import annotations

import pydantic
import pytest

from shared_numerics.mode import NumericsMismatchError, NumericsMode, check_same_numerics
from shared_numerics.settings import ZeroKLDSettings, ZeroKLDSettingsError


class _VllmConfig:
    def __init__(self, section):
        self.additional_config = {"zerokld": section}


def test_engine_and_trainer_read_the_same_settings(checkpoint_factory, tmp_path):
    from titan_plugin.rl import rl_trainer_config
    from vllm_plugin.config import from_vllm_config

    engine = from_vllm_config(
        _VllmConfig(
            {
                "batch_invariant": True,
                "fp8": "block",
                "hot_load": {"snapshot_root": str(tmp_path), "state_dir": str(tmp_path)},
            }
        )
    )
    trainer = rl_trainer_config(
        checkpoint_factory("qwen3", "bfloat16"), str(tmp_path / "d"), dtype="bfloat16", fp8="block"
    ).zerokld
    assert type(trainer) is ZeroKLDSettings and isinstance(engine, ZeroKLDSettings)
    assert engine.settings == trainer == ZeroKLDSettings(fp8="block")
    assert engine.mode("bfloat16") == trainer.mode("bfloat16")
    # one default per setting: an empty section and the trainer's defaults agree
    assert (
        from_vllm_config(_VllmConfig({})).settings
        == ZeroKLDSettings()
        == rl_trainer_config(checkpoint_factory("qwen3", "float32"), str(tmp_path / "e")).zerokld
    )


def test_rules_and_old_spellings_are_refused_on_both_sides(checkpoint_factory, tmp_path):
    from titan_plugin import trainer_logprobs
    from titan_plugin.rl import rl_trainer_config
    from vllm_plugin.config import ZeroKLDConfigError, from_vllm_config

    ckpt = checkpoint_factory("qwen3", "float32")
    for bad, match in (
        ({"batch_invariant": False, "fp8": "per_channel"}, "fp8 needs batch_invariant"),
        ({"batch_invariant": False, "tp_k_block": 16}, "tp_k_block needs batch_invariant"),
        ({"fp8": True}, "fp8 takes the granularity"),
        ({"fp8": "block", "tp_k_block": 16}, "tp_k_block with fp8"),
        ({"fp8": "tensor"}, "fp8"),
    ):
        with pytest.raises(ZeroKLDSettingsError, match=match):
            ZeroKLDSettings.parse(bad)
        with pytest.raises(ZeroKLDConfigError, match=match):
            from_vllm_config(_VllmConfig(bad))
        with pytest.raises(ZeroKLDSettingsError, match=match):
            rl_trainer_config(ckpt, str(tmp_path / "d"), **bad)
    with pytest.raises(ZeroKLDSettingsError, match="fp8 takes the granularity"):
        trainer_logprobs(ckpt, [[1, 2, 3]], [1], dtype="float32", fp8=True)
    with pytest.raises(pydantic.ValidationError, match="frozen"):  # immutable
        ZeroKLDSettings().fp8 = "block"


def test_a_settings_mismatch_names_the_setting_and_both_values():
    engine = ZeroKLDSettings(fp8="block").mode("bfloat16")
    snapshot = ZeroKLDSettings().mode("bfloat16")
    with pytest.raises(NumericsMismatchError, match=r"fp8: this replica 'block', snapshot None"):
        check_same_numerics(engine, snapshot.to_dict(), "this replica", "snapshot")
    check_same_numerics(engine, ZeroKLDSettings(fp8="block").mode("bfloat16").to_dict(), "this replica", "snapshot")
    assert ZeroKLDSettings(batch_invariant=False).mode("float32") == NumericsMode.build(False, "float32")
