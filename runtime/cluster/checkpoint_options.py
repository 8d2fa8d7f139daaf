"""The ``ckpt`` section of the config: where a job saves and loads its checkpoints, how often and what they hold
(slime's checkpoint flags), read by :mod:`runtime.cluster.checkpoint`. Torch-free: ``runtime.config`` composes
:class:`CheckpointConfig` into :class:`~runtime.config.Config` and checks it before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.option_fields import bounded, described, slime


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = field(
        default=None, metadata=described("checkpoint directory", slime=slime("megatron (reset by slime)", None))
    )
    save_interval: int | None = field(
        default=None,
        metadata=bounded(
            gt=0, help="save every this many steps (and at the end)", slime=slime("megatron (reset by slime)", None)
        ),
    )
    save_hf: str | None = field(
        default=None,
        metadata=described(
            "also write the model in HF format at every save, to this path formatted with {rollout_id}",
            slime=slime("algo", None),
        ),
    )
    start_rollout_id: int | None = field(
        default=None,
        metadata=described(
            "the first step to run (default: the --load checkpoint's next step, else 0)", slime=slime("data", None)
        ),
    )
    load: str | None = field(
        default=None,
        metadata=described(
            "checkpoint directory to resume from",
            slime=slime(
                "megatron (reset by slime)",
                None,
                differs="rlcore's own checkpoint folders (step_NNNNNN) to resume; with "
                "--train-backend megatron also a torch_dist checkpoint, whose weights the actor starts from "
                "(optimizer, RNG and step afresh)",
            ),
        ),
    )
    ref_load: str | None = field(
        default=None,
        metadata=described(
            "the reference model's HF folder (unset: --hf-checkpoint's weights)",
            slime=slime(
                "algo",
                None,
                differs="an HF folder (any backend) or, with --train-backend "
                "megatron, a torch_dist checkpoint, which is also the actor's start when --load holds no "
                "checkpoint (slime's rule); the torch backend takes HF folders only",
            ),
        ),
    )
    ref_ckpt_step: int | None = field(
        default=None,
        metadata=described(
            "--train-backend megatron: the step of a Megatron --ref-load save root to load (iter_NNNNNNN)",
            slime=slime(
                "algo",
                None,
                note="with --train-backend megatron: iter_NNNNNNN of a "
                "--ref-load save root (also the actor's start from it)",
            ),
        ),
    )
    no_save_optim: bool = field(
        default=False,
        metadata=described(
            "checkpoints leave the optimizer's state out (a resume starts it afresh)",
            slime=slime("megatron (reset by slime)", False),
        ),
    )
