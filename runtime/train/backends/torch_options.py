"""The torch backend's own options: the flags that only ``--train-backend torch`` reads (the Megatron backend has
its own optimizer, attention and model code, and no LoRA). ``runtime.config`` composes :class:`TorchOptions` into its
``train`` section, refuses these flags under another backend (from :data:`OWN_FIELDS`), and runs :func:`check` when
this backend is chosen."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from runtime.option_fields import described, own_fields, slime
from runtime.train.backends import lora_options


@dataclass(frozen=True)
class TorchOptions(lora_options.LoraOptions):
    """The torch backend's flags, LoRA's among them (peft on the transformers model)."""

    OWN = "a flag of the torch backend"

    use_stateless_adam: bool = field(
        default=False,
        metadata=described(
            own="the torch backend's stateless AdamW (Megatron's optimizer keeps its moments)",
            text="AdamW with its moments reset at every step and stored nowhere (needs --no-save-optim)",
            slime=slime("algo", False),
        ),
    )
    keep_old_actor: bool = field(
        default=False,
        metadata=described(
            own="a copy of the policy the torch backend keeps",
            text="one-step async: old log-probs from a CPU copy of the weights that sampled the rollout (needs "
            "--async)",
            slime=slime(
                "rollout",
                False,
                differs="needs --async and --update-weights-interval 1 (where slime's "
                "queue holds the sampling weights)",
            ),
        ),
    )
    attn_implementation: Literal["auto", "varlen", "sdpa", "flex_attention", "eager"] = field(
        default="auto",
        metadata=described(
            own="transformers' attention choice (the Megatron backend's is --attention-backend)",
            text="torch backend: the trainer's attention (transformers' attn_implementation, or varlen: PyTorch's "
            "flash varlen kernel over packed sequences, no mask); auto: varlen on a GPU whose PyTorch has it, else "
            "transformers' default",
        ),
    )
    torch_compile: bool = field(
        default=False,
        metadata=described(
            own="torch.compile of the transformers model",
            text="torch backend: torch.compile each decoder layer (fuses its norms, rotary, activation and residual "
            "adds; the first steps pay the compile)",
        ),
    )


# Each section of the config this backend adds fields to.
OPTIONS: dict[str, type] = {"train": TorchOptions}
# Every flag this backend alone reads -> what it is (the refusal under another backend names it).
OWN_FIELDS: dict[str, str] = own_fields(TorchOptions)
# Top-p replay (--rollout-top-p below 1): this backend takes each token's log-prob over the nucleus the engine
# reported (``rlcore.kernels.nucleus_log_probs``), the half of the replay a backend owes.
REPLAYS_TOP_P_NUCLEI = True


def check(problems: list[str], cfg: Any) -> None:
    """The torch backend's rules, when it is chosen."""
    if cfg.train.recompute_granularity == "selective":
        problems.append(
            "--recompute-granularity selective (Megatron's core-attention recompute): the torch backend "
            "recomputes whole decoder layers only (full)"
        )
    if cfg.train.use_stateless_adam and not cfg.ckpt.no_save_optim:
        problems.append("--use-stateless-adam keeps no optimizer state to save: add --no-save-optim (as slime asks)")
    lora_options.check(problems, cfg)
