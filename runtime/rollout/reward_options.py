"""The ``reward`` section of the config: the reward model type, custom reward functions, the reward key and
post-processing (slime's reward flags), read by :mod:`runtime.rollout.rewards`. Torch-free: ``runtime.config``
composes :class:`RewardConfig` into :class:`~runtime.config.Config` and checks it before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.option_fields import bounded, described, hook, slime

# Reward types rlcore-run scores with (builtin: the built-in task's), and slime's that it does not yet.
RM_TYPES = ("builtin", "math", "exact_match", "deepscaler", "dapo", "f1", "gpqa", "random", "remote_rm")
SLIME_RM_TYPES_NOT_BUILT = ("ifbench",)


@dataclass(frozen=True)
class RewardConfig:
    rm_type: str = field(
        default="builtin",
        metadata=described(
            "builtin (the default task's), math, exact_match, deepscaler, dapo, f1, gpqa, random, remote_rm, or "
            "boxed_<type> (scores the last \\boxed{} of the response)",
            slime=slime(
                "reward_model",
                None,
                differs="default builtin (ours: the built-in task's); adds "
                "exact_match; no ifbench; dapo and deepscaler compare with math-verify",
            ),
        ),
    )
    custom_rm_path: str | None = field(
        default=None,
        metadata=hook(
            "reward function as module:function or file.py:function; overrides --rm-type",
            slime=slime(
                "reward_model",
                None,
                differs="without --group-rm a batched function (told "
                "by its signature) is called once per sampling round",
            ),
        ),
    )
    reward_timeout: float = field(
        default=30.0, metadata=bounded(gt=0, help="seconds per reward call, sync or async; over it the reward is 0")
    )
    max_reward_error_rate: float = field(
        default=0.5,
        metadata=bounded(
            ge=0,
            le=1,
            help="ours: stop the job (exit 1) when more than this fraction of a step's rewards fail or time out for "
            "--max-reward-error-steps steps in a row; 1 never stops",
        ),
    )
    max_reward_error_steps: int = field(
        default=3,
        metadata=bounded(gt=0, help="ours: consecutive steps over --max-reward-error-rate that stop the job"),
    )
    rm_url: str | None = field(
        default=None,
        metadata=described("URL of the reward server of --rm-type remote_rm", slime=slime("reward_model", None)),
    )
    http_proxy: str | None = field(
        default=None,
        metadata=described(
            "HTTP proxy of --rm-type remote_rm's requests",
            slime=slime("network", None, differs="used by --rm-type remote_rm's requests (not the engines')"),
        ),
    )
    reward_key: str | None = field(
        default=None,
        metadata=described(
            "the entry of a dict reward that trains (unset: 'score')",
            slime=slime("reward_model", None, differs="unset: a dict reward trains on its 'score'"),
        ),
    )
    eval_reward_key: str | None = field(
        default=None,
        metadata=described(
            "the entry of a dict reward that evaluation reports (unset: --reward-key)",
            slime=slime("reward_model", None),
        ),
    )
    group_rm: bool = field(
        default=False,
        metadata=described(
            "--custom-rm-path is batched and called once per prompt's group", slime=slime("reward_model", False)
        ),
    )
    custom_reward_post_process_path: str | None = field(
        default=None,
        metadata=hook(
            "fn(args, samples) -> (raw_rewards, rewards), in place of the group normalisation",
            slime=slime("reward_model", None),
        ),
    )
    custom_convert_samples_to_train_data_path: str | None = field(
        default=None,
        metadata=hook(
            "fn(args, samples) -> dict of slime's train data (tokens, response_lengths, ...)",
            slime=slime("reward_model", None, note="its rewards are final"),
        ),
    )
