"""shared_numerics' registrations (entry point ``shared_numerics`` in the ``zerokld`` group): the RL losses and the
three numerics backends. They go through the same hooks as any third-party plugin."""

from __future__ import annotations

from zerokld_plugins import BackendSpec, LossSpec, hookimpl

_LOSSES = "shared_numerics.losses"


@hookimpl
def zerokld_losses():
    return [
        LossSpec(
            "cross_entropy", f"{_LOSSES}:cross_entropy_loss", f"{_LOSSES}:NoConfig", "-w*l (weights as advantages); SFT"
        ),
        LossSpec(
            "importance_sampling",
            f"{_LOSSES}:importance_sampling_loss",
            f"{_LOSSES}:NoConfig",
            "-exp(l-q)*A; Tinker importance_sampling",
        ),
        LossSpec(
            "ppo",
            f"{_LOSSES}:ppo_loss",
            f"{_LOSSES}:PPOConfig",
            "-min(r*A, clip(r, lo, hi)*A), r=exp(l-q); PPO (Schulman 2017) / GRPO (Shao 2024)",
        ),
        LossSpec(
            "dapo",
            f"{_LOSSES}:ppo_loss",
            f"{_LOSSES}:DAPOConfig",
            "ppo with clip-higher 0.8/1.28, token mean over the global batch; DAPO (Yu 2025)",
        ),
        LossSpec(
            "dr_grpo",
            f"{_LOSSES}:ppo_loss",
            f"{_LOSSES}:PPOConfig",
            "ppo; use dr_grpo_advantages and normalization='constant' (G*L_max); Dr.GRPO (Liu 2025)",
        ),
        LossSpec(
            "gspo",
            f"{_LOSSES}:gspo_loss",
            f"{_LOSSES}:GSPOConfig",
            "sequence ratio s=exp(mean(l-q)), token form; GSPO (Zheng 2025)",
        ),
        LossSpec(
            "cispo",
            f"{_LOSSES}:cispo_loss",
            f"{_LOSSES}:CISPOConfig",
            "-sg(clip(r, lo, hi))*A*l; CISPO (MiniMax-M1 2025)",
        ),
        LossSpec("dro", f"{_LOSSES}:dro_loss", f"{_LOSSES}:DROConfig", "-(l*A - beta/2*(l-q)^2); DRO (Richemond 2024)"),
    ]


@hookimpl
def zerokld_numerics_backends():
    return [
        BackendSpec("torch", "shared_numerics.ops_torch:OPS"),
        BackendSpec(
            "triton",
            "shared_numerics.ops_triton:OPS",
            "shared_numerics.ops_triton:available",
            "shared_numerics.ops_triton:unavailable_reason",
        ),
        BackendSpec(
            "cublas",
            "shared_numerics.ops_cublas:OPS",
            "shared_numerics.ops_cublas:available",
            "shared_numerics.ops_cublas:unavailable_reason",
        ),
    ]
