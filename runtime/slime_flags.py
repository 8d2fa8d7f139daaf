"""Every flag of slime's own argument groups, and what ``rlcore-run`` does with it: one table, read by the parser
(which flags to accept and refuse, and why) and rendered into ``docs/runtime.md`` (``python -m runtime.slime_flags
--write docs/runtime.md``; a test checks the two agree).

Each entry is one of

- ``yes``: a flag of ``runtime/config.py`` under slime's name, default and meaning;
- ``differs``: a flag of ``runtime/config.py`` under slime's name whose default, values or behaviour differ as the
  note says (by design, or until the named issue lands);
- ``refused``: accepted by the parser at slime's default (so a slime script that spells the default out runs) and
  refused at validation, naming the flag and why, when set to anything else;

The facts (names, groups, defaults) come from slime's ``slime/utils/arguments.py`` and
``slime/backends/sglang_utils/arguments.py`` at 624b824a; the Megatron flags slime resets (``reset_arg``) are
listed under the group that resets them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

YES, DIFFERS, REFUSED = "yes", "differs", "refused"
STATUSES = (YES, DIFFERS, REFUSED)

# Why a flag is refused, by what it needs.
MEGATRON = "not built in rlcore's Megatron backend yet (issue 11, still open)"
PACKING = "a packing knob rlcore does not have (--use-dynamic-batch-size packs by real tokens only)"
MEGATRON_ONLY = "--train-backend megatron only (the torch backend refuses it)"
CI_ONLY = "a switch of slime's own CI; rlcore's tests do not read it"
TEXT_ONLY = (
    "rlcore-run is text only: it has no image/audio/video processors or vision-language models to feed media to "
    "(leave it unset)"
)
DEEPGEMM = "selects SGLang-aligned DeepGEMM FP8 layers in Megatron, a hardware path rlcore does not have"
TORCH_HOOKS = "torch backend: model is the torch module, optimizer AdamW, opt_param_scheduler None"
DELTA_SYNC = (
    "delta sync needs the /pull_weights endpoint and delta loader of slime's patched SGLang, which SGLang 0.5.23 "
    "lacks: full only"
)
DELTA_SETTING = f"a setting of --update-weight-mode delta, refused ({DELTA_SYNC})"
PD_DISAGGREGATION = (
    "prefill/decode disaggregation needs SGLang's PD mode over an RDMA KV transfer (mooncake, nixl) between GPU "
    "servers, which rlcore's launcher does not build"
)
ROLLOUT_BUFFER = (
    "drives slime's rollout-buffer plugin server (slime_plugins/rollout_buffer), which rlcore does not have"
)


@dataclass(frozen=True)
class SlimeFlag:
    """One slime flag: its name, slime's group and default, rlcore's status and a note (the reason, for a refusal).

    ``kind`` says how the parser takes a refused flag: ``true`` (store_true), ``false`` (a ``--disable-*``
    store_false: giving it is the non-default), ``value`` (one value of ``type``), ``list`` (``nargs='+'``) or
    ``append`` (repeatable).
    """

    name: str
    group: str
    default: Any
    status: str
    note: str = ""
    kind: str = "value"
    type: Callable[[str], Any] = str

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")

    def refusal(self, value: Any) -> str | None:
        """The problem to report when a refused flag holds ``value``; None at slime's default."""
        if self.status != REFUSED:
            return None
        if self.kind == "false":
            is_default = value is False or value is None
        elif self.kind == "true":
            is_default = value is False or value is None
        else:
            is_default = value == self.default or (value is None and self.default is None)
        if is_default:
            return None
        shown = "" if self.kind in ("true", "false") else f" {_show(value)}"
        return f"{self.name}{shown}: {self.note}"


def _show(value: Any) -> str:
    if isinstance(value, list | tuple):
        return " ".join(map(str, value))
    return str(value)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expects JSON, got {text!r} ({err.msg})") from None


def _f(name: str, group: str, default: Any, status: str, note: str = "", **kw: Any) -> SlimeFlag:
    if "kind" not in kw:
        if isinstance(default, bool):
            kw["kind"] = "true"
        elif "type" not in kw and isinstance(default, int | float):
            kw["type"] = type(default)
    return SlimeFlag(name, group, default, status, note, **kw)


def _true(name: str, group: str, status: str, note: str = "") -> SlimeFlag:
    return SlimeFlag(name, group, False, status, note, kind="true")


def _disable(name: str, group: str, status: str, note: str = "") -> SlimeFlag:
    """A slime ``--disable-*`` flag (store_false into the positive name)."""
    return SlimeFlag(name, group, False, status, note, kind="false")


_OPT_INT = {"type": int}
_OPT_FLOAT = {"type": float}
_LIST = {"kind": "list"}

SLIME_FLAGS: tuple[SlimeFlag, ...] = (
    # cluster
    _f(
        "--actor-num-nodes",
        "cluster",
        1,
        DIFFERS,
        "above 1 only when rlcore-run joins a Ray cluster (RAY_ADDRESS); its own Ray is one node on 127.0.0.1",
    ),
    _f("--actor-num-gpus-per-node", "cluster", 8, YES, "built-in job: 1 (on a CPU a GPU is a process)"),
    _f(
        "--rollout-num-gpus",
        "cluster",
        None,
        DIFFERS,
        "unset: the trainers' GPUs under --colocate (slime's rule), else one engine's (slime needs it given); with "
        "--rollout-external-engine-addrs one engine's per server (slime asks each server for its GPUs)",
        type=int,
    ),
    _f("--rollout-num-gpus-per-engine", "cluster", 1, YES),
    _f(
        "--num-gpus-per-node",
        "cluster",
        8,
        YES,
        "launched server i gets --random-seed --seed + i x this; an engine wider than it (a multi-node server) is "
        "refused",
    ),
    _true(
        "--colocate",
        "cluster",
        DIFFERS,
        "the embedded engine offloads only when trainer and engine do not fit their GPU together (auto)",
    ),
    _true(
        "--offload",
        "cluster",
        DIFFERS,
        "sets --offload-train and --offload-rollout; refused beside --no-offload-train/-rollout (slime lets it win)",
    ),
    _f(
        "--offload-train",
        "cluster",
        None,
        DIFFERS,
        "unset under --colocate: auto (offload in the first step, then only if needed; SGLang engines always)",
        kind="true",
    ),
    _f("--offload-rollout", "cluster", None, DIFFERS, "unset under --colocate: auto, as --offload-train", kind="true"),
    # train
    _f("--qwen-gdn-backend", "train", "fla", REFUSED, "selects a Qwen gated-delta-net kernel, a path rlcore lacks"),
    _f("--train-env-vars", "train", {}, YES, type=_json),
    _f("--update-weight-mode", "train", "full", REFUSED, DELTA_SYNC),
    _f(
        "--update-weight-transport",
        "train",
        "nccl",
        DIFFERS,
        "unset: nccl for SGLang engines, the object store for the embedded engine",
    ),
    _true(
        "--release-train",
        "train",
        REFUSED,
        "kills the trainer actors after each weight sync and recreates them before the next train step, reloading "
        "them from the step's --save (slime needs full disk weight sync for it); rlcore's trainers are long-lived "
        "actors that keep their process groups, optimizer state and RNG in memory across steps",
    ),
    _f(
        "--update-weight-disk-dir",
        "train",
        None,
        DIFFERS,
        "unset with --update-weight-transport disk: a temporary folder (slime refuses the job)",
    ),
    _true("--update-weight-disk-keep-files", "train", YES),
    _f("--update-weight-delta-encoding", "train", "xor", REFUSED, DELTA_SETTING),
    _f("--update-weight-delta-checksum", "train", "xxh3-128", REFUSED, DELTA_SETTING),
    _f(
        "--custom-update-weight-post-write-path",
        "train",
        None,
        DIFFERS,
        "called once, in the driver, after trainer rank 0 (rlcore's only writer) wrote the folder; slime calls it on "
        "every trainer rank",
    ),
    _f(
        "--update-weight-local-checkpoint-dir",
        "train",
        None,
        REFUSED,
        "engines fill it through /pull_weights, an endpoint of slime's patched SGLang that SGLang 0.5.23 lacks",
    ),
    _f(
        "--custom-model-provider-path",
        "train",
        None,
        DIFFERS,
        f"{MEGATRON_ONLY}; the returned GPTModel is checked tensor by tensor against --hf-checkpoint",
    ),
    _true("--recompute-loss-function", "train", DIFFERS, MEGATRON_ONLY),
    _f(
        "--log-probs-chunk-size",
        "train",
        -1,
        REFUSED,
        "rlcore's fused log-prob kernel never materialises float32 logits and picks its own chunks",
    ),
    _f("--only-train-params-name-list", "train", None, YES, "regexes (re.search) over the backend's parameter names"),
    _f("--freeze-params-name-list", "train", None, YES, "regexes (re.search) over the backend's parameter names"),
    _true(
        "--allgather-cp",
        "train",
        REFUSED,
        "all-gathers the context-parallel sequence for DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5); "
        "rlcore builds dense Llama/Qwen models and no context parallelism (--context-parallel-size is refused)",
    ),
    # rollout
    _f("--hf-checkpoint", "rollout", None, YES, "unset: the built-in tiny model"),
    _f(
        "--model-name",
        "rollout",
        None,
        DIFFERS,
        f"{MEGATRON_ONLY}: picks the Megatron-to-HF mapping by slime's name rules (llama, qwen2, qwen3, qwen3moe); "
        "other families' names are refused",
    ),
    _f(
        "--rollout-function-path",
        "rollout",
        "slime.rollout.sglang_rollout.generate_rollout",
        DIFFERS,
        "unset: the built-in rollout (slime's default path is accepted and means it); --fully-async refused",
    ),
    _f("--rollout-temperature", "rollout", 1.0, YES),
    _f(
        "--rollout-top-p",
        "rollout",
        1.0,
        YES,
        "below 1: nucleus replay (embedded engine, torch backend); --no-rollout-top-p-replay (ours) opts out",
    ),
    _f("--rollout-top-k", "rollout", -1, YES),
    _f(
        "--rollout-max-context-len",
        "rollout",
        None,
        YES,
        "as in slime: sets --rollout-max-prompt-len's default (context - 1) and checks it",
    ),
    _f("--rollout-max-prompt-len", "rollout", None, YES),
    _f("--rollout-max-response-len", "rollout", None, YES, "built-in job: 8"),
    _true("--rollout-skip-special-tokens", "rollout", YES, "built-in job: on"),
    _f("--rollout-stop", "rollout", None, YES, "", **_LIST),
    _f("--rollout-stop-token-ids", "rollout", None, YES),
    _true("--rollout-shuffle", "rollout", YES, "built-in job: on"),
    _f("--rollout-seed", "rollout", 42, YES, "the built-in task's prompts are drawn and shuffled from --seed"),
    _f("--over-sampling-batch-size", "rollout", None, DIFFERS, "rounds run in order (not first-completed)"),
    _f("--dynamic-sampling-filter-path", "rollout", None, YES),
    _true("--partial-rollout", "rollout", DIFFERS, "needs --fully-async (ours), where generations cross syncs"),
    _true("--mask-offpolicy-in-partial-rollout", "rollout", YES),
    _f("--custom-generate-function-path", "rollout", None, YES, "engines through runtime.rollout.engine_generate"),
    _f("--rollout-sample-hook-path", "rollout", [], YES, kind="append"),
    _f("--custom-rollout-log-function-path", "rollout", None, YES),
    _f("--custom-eval-rollout-log-function-path", "rollout", None, YES),
    _f("--buffer-filter-path", "rollout", None, YES, "the default data source's buffer (rollout functions)"),
    _f("--update-weight-buffer-size", "rollout", 512 * 1024**2, YES),
    _f("--update-weights-interval", "rollout", 1, YES),
    _true(
        "--keep-old-actor",
        "rollout",
        DIFFERS,
        "needs --async and --update-weights-interval 1 (where slime's queue holds the sampling weights)",
    ),
    _f("--rollout-data-postprocess-path", "rollout", None, YES, "on every trainer rank, over its shard"),
    _f(
        "--rollout-data-transport",
        "rollout",
        "object-store",
        REFUSED,
        "nixl is a hardware transport rlcore lacks; batches go through Ray's object store",
    ),
    _f("--rollout-external-engine-addrs", "rollout", None, YES, **_LIST),
    # fault tolerance
    _true(
        "--use-fault-tolerance",
        "fault_tolerance",
        DIFFERS,
        "on by default (--no-use-fault-tolerance is slime's default); a dead engine's requests go to live engines at "
        "once and it is restarted at once, not at the next weight update",
    ),
    _f("--rollout-health-check-interval", "fault_tolerance", 30.0, YES),
    _f("--rollout-health-check-timeout", "fault_tolerance", 30.0, YES),
    _f("--rollout-health-check-first-wait", "fault_tolerance", 0.0, YES),
    # data
    _f("--num-rollout", "data", None, YES, "built-in job: 250; unset: from --num-epoch"),
    _f("--num-epoch", "data", None, YES),
    _disable("--disable-rollout-global-dataset", "data", YES),
    _f(
        "--data-source-path",
        "data",
        "slime.rollout.data_source.RolloutDataSourceWithBuffer",
        DIFFERS,
        "unset: the prompt data with a buffer (slime's default path is accepted and means it)",
    ),
    _f("--prompt-data", "data", None, YES, "unset: the built-in task"),
    _true("--apply-chat-template", "data", YES),
    _f("--apply-chat-template-kwargs", "data", {}, YES),
    _f("--input-key", "data", "input", YES),
    _f("--label-key", "data", None, YES),
    _f("--multimodal-keys", "data", None, REFUSED, TEXT_ONLY, type=_json),
    _f("--metadata-key", "data", "metadata", YES),
    _f("--tool-key", "data", "tools", YES),
    _f("--start-rollout-id", "data", None, YES),
    _f("--rollout-batch-size", "data", None, YES, "required, as in slime; built-in job: 32"),
    _f("--n-samples-per-prompt", "data", 1, YES, "built-in job: 8; 1 is refused with a group baseline (by design)"),
    _f("--num-steps-per-rollout", "data", None, YES),
    _true("--balance-data", "data", DIFFERS, "greedy within each optimizer step (slime: Karmarkar-Karp)"),
    _true("--balance-by-flops", "data", REFUSED, PACKING),
    _true(
        "--use-dynamic-batch-size",
        "data",
        DIFFERS,
        "torch backend: a packed row per micro-batch (attention split by position ids); megatron: rows grouped by "
        "real tokens, each group padded (no THD packing without Transformer Engine)",
    ),
    _f(
        "--max-tokens-per-gpu",
        "data",
        None,
        DIFFERS,
        "real tokens with --use-dynamic-batch-size; without it, rows x longest row, applied whenever set",
    ),
    _f(
        "--log-probs-max-tokens-per-gpu",
        "data",
        None,
        DIFFERS,
        "both backends; counted as --max-tokens-per-gpu is (real tokens with --use-dynamic-batch-size)",
        **_OPT_INT,
    ),
    # eval
    _f("--eval-function-path", "eval", None, YES, "unset: the rollout function when one is given"),
    _f("--eval-prompt-data", "eval", None, YES, "name/path pairs; one bare path is named aime, as in slime"),
    _f(
        "--eval-config",
        "eval",
        None,
        DIFFERS,
        "read with PyYAML (no OmegaConf interpolation); per-dataset keys beyond rlcore-run's are refused by name",
    ),
    _true("--skip-eval-before-train", "eval", YES),
    _f("--eval-input-key", "eval", None, YES),
    _f("--eval-label-key", "eval", None, YES),
    _f("--eval-tool-key", "eval", None, YES),
    _f("--n-samples-per-eval-prompt", "eval", 1, YES),
    _f("--eval-temperature", "eval", None, YES),
    _f("--eval-top-p", "eval", None, YES),
    _f("--eval-top-k", "eval", None, YES),
    _f("--eval-max-response-len", "eval", None, YES),
    _f("--eval-max-prompt-len", "eval", None, YES),
    _f("--eval-min-new-tokens", "eval", None, YES, **_OPT_INT),
    _f("--eval-max-context-len", "eval", None, YES, "as in slime: recorded, defaulting to --rollout-max-context-len"),
    # algo
    _f(
        "--ref-load",
        "algo",
        None,
        DIFFERS,
        "an HF folder (any backend) or, with --train-backend megatron, a torch_dist checkpoint, which is also the "
        "actor's start when --load holds no checkpoint (slime's rule); the torch backend takes HF folders only",
    ),
    _f(
        "--ref-ckpt-step",
        "algo",
        None,
        YES,
        "with --train-backend megatron: iter_NNNNNNN of a --ref-load save root (also the actor's start from it)",
        **_OPT_INT,
    ),
    _f("--save-hf", "algo", None, YES),
    _f("--num-critic-only-steps", "algo", 0, YES),
    _f(
        "--megatron-config-path",
        "algo",
        None,
        DIFFERS,
        f"{MEGATRON_ONLY}; the actor entry's overrides take the trainers' flags (train and algo sections); a critic "
        "entry is refused (the Megatron critic trains with the actor's flags)",
    ),
    _f("--eps-clip", "algo", 0.2, YES),
    _f("--eps-clip-high", "algo", None, YES),
    _f("--eps-clip-c", "algo", None, YES),
    _f("--value-clip", "algo", 0.2, YES, "the critic's value loss (ppo)"),
    _f("--kl-coef", "algo", 0.0, YES, "ignored by grpo/gspo/cispo/dr_grpo, as slime ignores it"),
    _f("--loss-type", "algo", "policy_loss", YES),
    _f("--custom-loss-function-path", "algo", None, DIFFERS, "logits [1, T, V] over the padded rows, one by one"),
    _f("--kl-loss-type", "algo", "k1", YES),
    _f(
        "--advantage-estimator",
        "algo",
        "grpo",
        DIFFERS,
        "adds dr_grpo, rloo, on_policy_distillation; ppo's critic is a value-head copy of the model in the trainers",
    ),
    _disable("--disable-compute-advantages-and-returns", "algo", YES, "with --loss-type sft_loss or custom_loss"),
    _f("--custom-advantage-function-path", "algo", None, YES, "on every trainer rank, over its shard"),
    _true("--use-kl-loss", "algo", YES, "built-in job: on"),
    _f("--kl-loss-coef", "algo", 0.0, YES),
    _true("--use-unbiased-kl", "algo", YES),
    _f("--ref-update-interval", "algo", None, YES),
    _f("--entropy-coef", "algo", 0.0, YES),
    _f("--gamma", "algo", 1.0, YES),
    _f("--lambd", "algo", 1.0, YES),
    _true("--normalize-advantages", "algo", DIFFERS, "not required for reinforce_plus_plus[_baseline]"),
    _disable("--disable-grpo-std-normalization", "algo", YES),
    _disable("--disable-rewards-normalization", "algo", YES),
    _true("--use-rollout-entropy", "algo", DIFFERS, "torch backend only; not in the --keep-old-actor pass"),
    _true("--get-mismatch-metrics", "algo", YES),
    _true("--reset-optimizer-states", "algo", YES),
    _true("--use-stateless-adam", "algo", YES),
    _true("--use-rollout-logprobs", "algo", YES),
    _true("--use-tis", "algo", YES),
    _f("--tis-clip", "algo", 2.0, YES),
    _f("--tis-clip-low", "algo", 0.0, YES),
    _f("--custom-tis-function-path", "algo", None, DIFFERS, "torch backend only; metrics are token means"),
    _f("--custom-pg-loss-reducer-function-path", "algo", None, YES, "the pg term's reducer (--loss-agg-mode is ours)"),
    _true("--use-routing-replay", "algo", REFUSED, MEGATRON + " (MoE routing replay)"),
    _true("--use-rollout-routing-replay", "algo", REFUSED, MEGATRON + " (MoE routing replay)"),
    _true("--use-opsm", "algo", YES),
    _f("--opsm-delta", "algo", 1e-4, YES),
    # on-policy distillation
    _true("--use-opd", "on_policy_distillation", YES),
    _f(
        "--opd-type",
        "on_policy_distillation",
        None,
        YES,
        "megatron: a teacher model in the trainers, any backend; sglang: a teacher server, through slime's "
        "on_policy_distillation reward pair",
    ),
    _f("--opd-kl-coef", "on_policy_distillation", 1.0, YES),
    _f(
        "--opd-teacher-load",
        "on_policy_distillation",
        None,
        DIFFERS,
        "an HF folder; with --train-backend megatron also a torch_dist checkpoint (slime: a Megatron checkpoint)",
    ),
    _f(
        "--opd-teacher-ckpt-step",
        "on_policy_distillation",
        None,
        DIFFERS,
        f"{MEGATRON_ONLY}: iter_NNNNNNN of a --opd-teacher-load save root",
        **_OPT_INT,
    ),
    # wandb
    _true("--use-wandb", "wandb", YES),
    _f("--wandb-mode", "wandb", None, YES),
    _f("--wandb-dir", "wandb", None, YES, "unset: --output-dir"),
    _f("--wandb-key", "wandb", None, YES),
    _f("--wandb-host", "wandb", None, YES),
    _f("--wandb-team", "wandb", None, YES),
    _f("--wandb-group", "wandb", None, YES),
    _disable("--disable-wandb-random-suffix", "wandb", YES),
    _true("--wandb-always-use-train-step", "wandb", YES, "TensorBoard's axis too; metrics.jsonl keeps the rollout"),
    _true("--log-multi-turn", "wandb", YES),
    _true("--log-passrate", "wandb", YES),
    _f("--log-reward-category", "wandb", None, YES),
    _true(
        "--log-correct-samples",
        "wandb",
        YES,
        "rollout/correct_entropy is the mean over correct samples (slime's sums their sample means)",
    ),
    _f("--wandb-run-id", "wandb", None, YES),
    # tensorboard
    _true("--use-tensorboard", "tensorboard", YES, "built-in job: on"),
    _f("--tb-project-name", "tensorboard", None, YES, "unset (and no $TENSORBOARD_DIR): --output-dir/tensorboard"),
    _f("--tb-experiment-name", "tensorboard", None, YES),
    # debug
    _f("--save-debug-rollout-data", "debug", None, YES, "evaluation rollouts are not saved"),
    _f(
        "--load-forge-rollout-data",
        "debug",
        None,
        YES,
        "read by --rollout-function-path slime.rollout.forge_load.generate_rollout (engines stay live)",
    ),
    _f("--load-debug-rollout-data-subsample", "debug", None, YES),
    _f("--save-debug-train-data", "debug", None, DIFFERS, "one file per step: the whole batch, from the driver"),
    _f("--dump-details", "debug", None, YES),
    _f("--memory-snapshot-dir", "debug", ".", YES),
    _f("--memory-snapshot-num-steps", "debug", None, YES, **_OPT_INT),
    _f(
        "--profile-target",
        "debug",
        ["train_overall"],
        DIFFERS,
        "train_overall only (train_actor / train_log_probs are Megatron's --use-pytorch-profiler targets)",
        **_LIST,
    ),
    _f("--memory-recorder", "debug", "torch", DIFFERS, "torch only (memray is not a dependency)"),
    _true("--check-weight-update-equal", "debug", YES),
    # network
    _f("--http-proxy", "network", None, DIFFERS, "used by --rm-type remote_rm's requests (not the engines')"),
    _true(
        "--use-distributed-post",
        "network",
        REFUSED,
        "spreads SGLang HTTP posts over per-node Ray actors of a multi-node fleet; rlcore-run runs on one node and "
        "posts from the driver's event loop",
    ),
    # reward model
    _f(
        "--rm-type",
        "reward_model",
        None,
        DIFFERS,
        "default builtin (ours: the built-in task's); adds exact_match; no ifbench; dapo and deepscaler compare with "
        "math-verify",
    ),
    _f("--reward-key", "reward_model", None, DIFFERS, "unset: a dict reward trains on its 'score'"),
    _f("--eval-reward-key", "reward_model", None, YES),
    _true("--group-rm", "reward_model", YES),
    _f("--rm-url", "reward_model", None, YES),
    _f(
        "--custom-rm-path",
        "reward_model",
        None,
        DIFFERS,
        "without --group-rm a batched function (told by its signature) is called once per sampling round",
    ),
    _f("--custom-reward-post-process-path", "reward_model", None, YES),
    _f("--custom-convert-samples-to-train-data-path", "reward_model", None, YES, "its rewards are final"),
    # rollout buffer
    _f("--rollout-buffer-url", "rollout_buffer", None, REFUSED, ROLLOUT_BUFFER),
    _f("--fetch-trajectory-retry-times", "rollout_buffer", -1, REFUSED, ROLLOUT_BUFFER),
    _f("--min-batch-collection-ratio", "rollout_buffer", 1.0, REFUSED, ROLLOUT_BUFFER),
    _f("--rollout-task-type", "rollout_buffer", "math", REFUSED, ROLLOUT_BUFFER),
    _f("--loss-mask-type", "rollout_buffer", "qwen", YES, "sft_rollout's loss masks by chat template"),
    _f("--data-pad-size-multiplier", "rollout_buffer", 128, REFUSED, PACKING),
    _f("--rollout-sample-filter-path", "rollout_buffer", None, YES),
    _f("--rollout-all-samples-process-path", "rollout_buffer", None, YES, "built-in rollout; not with --fully-async"),
    # custom Megatron plugins
    _f("--custom-megatron-init-path", "custom_megatron_plugins", None, DIFFERS, TORCH_HOOKS),
    _f("--custom-megatron-before-log-prob-hook-path", "custom_megatron_plugins", None, DIFFERS, TORCH_HOOKS),
    _f("--custom-megatron-before-train-step-hook-path", "custom_megatron_plugins", None, DIFFERS, TORCH_HOOKS),
    _f("--megatron-deepgemm-forward-layers", "custom_megatron_plugins", None, REFUSED, DEEPGEMM, **_LIST),
    _f("--megatron-deepgemm-forward-modules", "custom_megatron_plugins", None, REFUSED, DEEPGEMM, **_LIST),
    _f("--megatron-deepgemm-moe-forward-layers", "custom_megatron_plugins", None, REFUSED, DEEPGEMM, **_LIST),
    _f("--megatron-deepgemm-moe-forward-modules", "custom_megatron_plugins", None, REFUSED, DEEPGEMM, **_LIST),
    # MTP training
    _true("--enable-mtp-training", "mtp_training", REFUSED, MEGATRON + " (MTP layers)"),
    _f("--mtp-num-layers", "mtp_training", None, REFUSED, MEGATRON + " (MTP layers)", **_OPT_INT),
    _f("--mtp-loss-scaling-factor", "mtp_training", 0.2, REFUSED, MEGATRON + " (MTP layers)"),
    # CI
    _true("--ci-test", "ci", REFUSED, CI_ONLY),
    _true("--ci-disable-kl-checker", "ci", REFUSED, CI_ONLY),
    _f("--ci-train-rollout-logprob-abs-diff-threshold", "ci", 0.1, REFUSED, CI_ONLY),
    _f("--ci-save-grad-norm", "ci", None, REFUSED, CI_ONLY),
    _f("--ci-load-grad-norm", "ci", None, REFUSED, CI_ONLY),
    # _pre_parse_mode
    _f(
        "--train-backend",
        "mode",
        "megatron",
        DIFFERS,
        "default torch (by design); megatron: megatron-core, local spec",
    ),
    _true("--debug-rollout-only", "mode", YES),
    _true("--debug-train-only", "mode", DIFFERS, "needs --load-debug-rollout-data"),
    _f("--load-debug-rollout-data", "mode", None, YES),
    # SGLang (slime/backends/sglang_utils/arguments.py)
    _f("--sglang-router-ip", "sglang", None, YES),
    _f("--sglang-router-port", "sglang", None, YES),
    _f("--sglang-router-request-timeout-secs", "sglang", 14400, YES),
    _f(
        "--sglang-server-concurrency",
        "sglang",
        512,
        YES,
        "requests in flight through the router: this x the engines (slime's semaphore)",
    ),
    _f("--prefill-num-servers", "sglang", None, REFUSED, PD_DISAGGREGATION, **_OPT_INT),
    _f(
        "--sglang-config",
        "sglang",
        None,
        REFUSED,
        "server groups from YAML (prefill/decode/placeholder workers, several models): rlcore launches one group "
        "of regular servers, from --rollout-num-gpus and the --sglang-* flags",
    ),
    # Megatron flags whose defaults slime resets (reset_arg)
    _f(
        "--distributed-backend",
        "megatron (reset by slime)",
        "nccl",
        DIFFERS,
        f"{MEGATRON_ONLY}; trainers on the CPU use gloo whatever is given",
    ),
    _f("--distributed-timeout-minutes", "megatron (reset by slime)", 10, DIFFERS, MEGATRON_ONLY),
    _true(
        "--freeze-indexer",
        "megatron (reset by slime)",
        REFUSED,
        "freezes the indexer of DeepSeek sparse attention (DSA), a module of models rlcore does not build (dense "
        "Llama/Qwen only); --freeze-params-name-list freezes parameters by name",
    ),
    _f("--global-batch-size", "megatron (reset by slime)", None, YES, "unset: rollout x n / steps per rollout"),
    _f("--micro-batch-size", "megatron (reset by slime)", 1, YES, "built-in job: 8"),
    _f("--eval-interval", "megatron (reset by slime)", None, YES),
    _f(
        "--load",
        "megatron (reset by slime)",
        None,
        DIFFERS,
        "rlcore's own checkpoint folders (step_NNNNNN) to resume; with --train-backend megatron also a torch_dist "
        "checkpoint, whose weights the actor starts from (optimizer, RNG and step afresh)",
    ),
    _f("--save", "megatron (reset by slime)", None, YES),
    _f("--save-interval", "megatron (reset by slime)", None, YES),
    _true(
        "--async-save",
        "megatron (reset by slime)",
        REFUSED,
        "Megatron-LM's asynchronous save (megatron.training.async_utils, a background writer finalised at the next "
        "save): rlcore saves synchronously, so a checkpoint's latest pointer and manifest name only finished files",
    ),
    _true("--no-save-optim", "megatron (reset by slime)", YES),
    _f("--seed", "megatron (reset by slime)", 1234, YES),
    _f("--clip-grad", "megatron (reset by slime)", 1.0, YES),
    _true("--calculate-per-token-loss", "megatron (reset by slime)", YES, "built-in job: on"),
    _f("--lr", "megatron (reset by slime)", 1e-6, YES, "built-in job: 1e-3"),
    _f("--wandb-project", "megatron (reset by slime)", None, YES),
    _true("--record-memory-history", "megatron (reset by slime)", YES, "the trainers' CUDA allocator; needs CUDA"),
    _f(
        "--custom-config-path",
        "megatron (reset by slime)",
        None,
        YES,
        "its keys override the command line; the ones that are no flag reach hooks as args.<key>",
    ),
    _f(
        "--padded-vocab-size",
        "megatron (reset by slime)",
        None,
        DIFFERS,
        f"{MEGATRON_ONLY}; exports cut the padding off; smaller than the vocabulary is refused",
        **_OPT_INT,
    ),
)
BY_NAME: dict[str, SlimeFlag] = {f.name: f for f in SLIME_FLAGS}
if len(BY_NAME) != len(SLIME_FLAGS):
    raise RuntimeError("a slime flag is listed twice")
PARSED_REFUSED = tuple(f for f in SLIME_FLAGS if f.status == REFUSED)
REFUSED_BY_DEST: dict[str, SlimeFlag] = {f.dest: f for f in PARSED_REFUSED}

# Flags slime generates or takes from Megatron, by prefix or name: refused with the issue that brings them.
_OWNED_PREFIXES = (
    ("--sglang-", "not a flag of SGLang 0.5.23's ServerArgs (runtime/engines/sglang_flags.json)"),
    ("--router-", "not a flag of sglang-router's RouterArgs (runtime/engines/sglang_flags.json)"),
)
# Megatron's own flags that rlcore-run parses (``runtime/config.py``: the train section's for --train-backend
# megatron, the model section's shape flags checked against config.json), under Megatron's names and meanings. The
# values the Megatron backend builds are ``runtime.config.MEGATRON_VALUES_BUILT``'s.
MEGATRON_PARSED = frozenset(
    """
    --tensor-model-parallel-size --sequence-parallel --pipeline-model-parallel-size --context-parallel-size
    --recompute-granularity --recompute-method --recompute-num-layers --optimizer --adam-beta1 --adam-beta2
    --adam-eps --accumulate-allreduce-grads-in-fp32 --lr-decay-style --min-lr --lr-warmup-fraction
    --lr-warmup-iters --lr-decay-iters --num-layers --hidden-size --ffn-hidden-size --num-attention-heads
    --group-query-attention --num-query-groups --kv-channels --qk-layernorm --swiglu --rotary-base --rotary-percent
    --disable-bias-linear --add-qkv-bias --normalization --norm-epsilon --vocab-size
    --untie-embeddings-and-output-weights --position-embedding-type --max-position-embeddings
    --use-distributed-optimizer --use-rotary-position-embeddings --attention-backend --attention-dropout
    --hidden-dropout --expert-model-parallel-size --expert-tensor-parallel-size --deterministic-mode
    --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --overlap-grad-reduce --ddp-bucket-size
    --bias-swiglu-fusion --num-experts --moe-router-topk --moe-ffn-hidden-size --moe-router-pre-softmax
    --moe-router-score-function --moe-layer-freq --moe-grouped-gemm --moe-token-dispatcher-type
    --moe-router-load-balancing-type --moe-aux-loss-coeff --moe-router-dtype --moe-token-drop-policy
    """.split()
)


class MegatronFlag(NamedTuple):
    """What rlcore-run does with one of Megatron's other flags: ``accepted`` switches are taken by --train-backend
    megatron, whose backend already does what they ask (``reason`` says how); the others are refused, naming
    ``reason``. Every one is refused under the torch backend."""

    accepted: bool
    reason: str


UNFUSED = (
    "the local layer spec runs this path unfused anyway (the fused kernels need apex or Transformer Engine), so the "
    "switch changes nothing"
)
MOE = (
    "a MoE layout rlcore's Megatron backend does not build yet: it builds Qwen3-MoE's (softmax router, no shared "
    "expert, no expert bias)"
)
FP8 = "FP8 training needs Transformer Engine, which is not installed (the local layer spec trains in bf16)"
MLA = "multi-latent attention (DeepSeek, Kimi) is not built: the families built are Llama, Qwen2 and Qwen3"
GLM4 = "GLM-4's layer layout is not built: the families built are Llama, Qwen2 and Qwen3"
STAGES = "the backend splits the layers into equal pipeline stages, without virtual stages"
FRESH = (
    "rlcore's --load resumes a job whole; a torch_dist --load (or --ref-load) already starts the optimizer, RNG "
    "and step afresh, as slime does"
)
_MOE_FLAGS = """
    --moe-shared-expert-intermediate-size --moe-router-enable-expert-bias --moe-router-bias-update-rate
    --moe-router-topk-scaling-factor
""".split()
# Megatron's other flags that slime's run scripts use. --weight-decay and --bf16 are rlcore's own too (the torch
# backend's), so they are parsed, not listed here.
MEGATRON_FLAGS: dict[str, MegatronFlag] = {
    **{
        name: MegatronFlag(True, UNFUSED)
        for name in (
            "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion",
            "--no-bias-dropout-fusion",
            "--no-rope-fusion",
        )
    },
    "--attention-softmax-in-fp32": MegatronFlag(
        True, "the backend always runs the attention softmax in float32 (TransformerConfig.attention_softmax_in_fp32)"
    ),
    "--use-checkpoint-opt_param-scheduler": MegatronFlag(
        True,
        "the backend's OptimizerParamScheduler always takes the LR schedule's values from the checkpoint on a resume "
        "(use_checkpoint_opt_param_scheduler=True)",
    ),
    "--use-precision-aware-optimizer": MegatronFlag(
        False,
        "megatron-core 0.16.1's OptimizerConfig needs Transformer Engine for it (its FusedAdam and version), which "
        "is not installed; with --optimizer-cpu-offload too",
    ),
    **{name: MegatronFlag(False, MOE) for name in _MOE_FLAGS},
    "--moe-permute-fusion": MegatronFlag(
        True,
        "megatron-core's unfused permutation is what the local layer spec runs (the fused one is Transformer "
        "Engine's): the same tokens in the same order",
    ),
    "--moe-enable-deepep": MegatronFlag(
        False, "DeepEP's flex dispatcher is not installed; the backend dispatches tokens with alltoall"
    ),
    **{name: MegatronFlag(False, FP8) for name in ("--fp8-format", "--fp8-recipe", "--fp8-param-gather")},
    **{
        name: MegatronFlag(False, MLA)
        for name in (
            "--q-lora-rank",
            "--kv-lora-rank",
            "--qk-head-dim",
            "--qk-pos-emb-head-dim",
            "--v-head-dim",
            "--multi-latent-attention",
        )
    },
    **{
        name: MegatronFlag(False, GLM4 + f" ({what})")
        for name, what in (
            ("--post-self-attn-layernorm", "a norm after self-attention"),
            ("--post-mlp-layernorm", "a norm after the MLP"),
            ("--rotary-interleaved", "interleaved rotary pairs"),
        )
    },
    **{
        name: MegatronFlag(False, STAGES)
        for name in (
            "--decoder-first-pipeline-num-layers",
            "--decoder-last-pipeline-num-layers",
            "--num-layers-per-virtual-pipeline-stage",
        )
    },
    **{name: MegatronFlag(False, FRESH) for name in ("--no-load-optim", "--no-load-rng", "--finetune")},
    "--spec": MegatronFlag(
        False, "a layer spec of slime's plugins: the backend builds megatron-core's local GPT layer spec"
    ),
    "--transformer-impl": MegatronFlag(
        False, "the backend builds megatron-core's local layer spec (Transformer Engine is not installed)"
    ),
    "--use-flash-attn": MegatronFlag(
        False, "flash attention through Megatron needs Transformer Engine, which is not installed"
    ),
    "--fp16": MegatronFlag(False, "float16 training needs a loss scaler the backend does not build; use --bf16"),
    "--ckpt-format": MegatronFlag(False, "the backend reads and writes torch_dist checkpoints only"),
    "--make-vocab-size-divisible-by": MegatronFlag(
        False, "the backend pads the vocabulary to Megatron's default multiple (128 x TP)"
    ),
    "--seq-length": MegatronFlag(False, "sequences are as long as each sample (slime sets it for Megatron only)"),
    "--init-method-std": MegatronFlag(False, "the weights always come from the checkpoint"),
    "--log-interval": MegatronFlag(False, "rlcore-run logs every step"),
}
_SWITCH_PREFIX = "megatron_switch:"


def unknown_flag_problem(arg: str) -> str:
    """The problem to report for a flag the parser did not take: whose it is and why it is refused."""
    name = arg.split("=", 1)[0]
    if name in BY_NAME:
        return f"{name}: {BY_NAME[name].note}"
    for prefix, reason in _OWNED_PREFIXES:
        if name.startswith(prefix):
            return f"{name}: {reason}"
    if name in MEGATRON_FLAGS:
        return f"{name}: a Megatron flag rlcore's Megatron backend does not take: {MEGATRON_FLAGS[name].reason}"
    return f"{name}: unrecognized argument (neither rlcore's nor slime's)"


def unknown_flags(extras: Sequence[str]) -> list[str]:
    """The flags among argparse's leftover arguments (their values are dropped)."""
    return [a for a in extras if a.startswith("--")]


def add_refused_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every ``refused`` slime flag to ``parser`` (defaults suppressed), in a group of its own."""
    group = parser.add_argument_group(
        "slime flags rlcore-run accepts at slime's default only",
        "Each is refused, naming why, when set to anything else (docs/runtime.md lists them).",
    )
    for f in PARSED_REFUSED:
        help_text = f"refused: {f.note}"
        if f.kind == "true":
            group.add_argument(f.name, dest=f.dest, action="store_const", const=True, help=help_text)
        elif f.kind == "false":
            group.add_argument(f.name, dest=f.dest, action="store_const", const=True, help=help_text)
        elif f.kind == "list":
            group.add_argument(f.name, dest=f.dest, nargs="*", type=f.type, help=help_text)
        elif f.kind == "append":
            group.add_argument(f.name, dest=f.dest, action="append", type=f.type, help=help_text)
        else:
            group.add_argument(f.name, dest=f.dest, type=f.type, help=help_text)


def add_megatron_switches(parser: argparse.ArgumentParser) -> None:
    """Add the Megatron switches that --train-backend megatron accepts (``MEGATRON_FLAGS``), in a group of their own;
    :func:`pop_megatron_switches` takes them back out of the parsed namespace."""
    group = parser.add_argument_group(
        "Megatron switches that --train-backend megatron accepts",
        "Its backend already does what they ask; the torch backend refuses them.",
    )
    for name, entry in MEGATRON_FLAGS.items():
        if entry.accepted:
            group.add_argument(name, dest=_SWITCH_PREFIX + name, action="store_true", help=f"accepted: {entry.reason}")


def pop_megatron_switches(namespace: dict[str, Any]) -> list[str]:
    """The accepted Megatron switches given (by name), removed from ``namespace`` (argparse's, as a dict)."""
    return [
        key[len(_SWITCH_PREFIX) :] for key in list(namespace) if key.startswith(_SWITCH_PREFIX) and namespace.pop(key)
    ]


def megatron_switch_problems(names: Iterable[str], *, backend: str) -> list[str]:
    """Problems for the accepted Megatron switches ``names`` under ``backend``: none under megatron."""
    if backend == "megatron":
        return []
    return [f"{name}: a Megatron flag, taken by --train-backend megatron only ({backend} backend)" for name in names]


def refused_problems(values: dict[str, Any]) -> list[str]:
    """Problems for the refused flags among ``values`` (by dest) that are set away from slime's default."""
    problems = []
    for dest, value in values.items():
        flag = REFUSED_BY_DEST[dest]
        if flag.kind == "list" and isinstance(value, list) and isinstance(flag.default, list):
            value = list(value)
        problem = flag.refusal(value)
        if problem:
            problems.append(problem)
    return problems


def counts() -> dict[str, int]:
    out = {status: 0 for status in STATUSES}
    for f in SLIME_FLAGS:
        out[f.status] += 1
    return out


_DOC_BEGIN = "<!-- slime-flags:begin (generated by `python -m runtime.slime_flags --write docs/runtime.md`) -->"
_DOC_END = "<!-- slime-flags:end -->"
_STATUS_WORDS = {
    YES: "yes",
    DIFFERS: "yes, differs",
    REFUSED: "refused unless default",
}


def _cell(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else f"'{value}'"
    return text.replace("|", "\\|")


def render_markdown() -> str:
    """The docs table of every slime flag, between its markers."""
    c = counts()
    lines = [
        _DOC_BEGIN,
        "",
        f"{len(SLIME_FLAGS)} flags: {c[YES]} supported as in slime, {c[DIFFERS]} supported with a difference, "
        f"{c[REFUSED]} accepted at slime's default and refused otherwise.",
        "",
        "| group | flag | slime default | rlcore-run | note |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in SLIME_FLAGS:
        note = f.note.replace("|", "\\|")
        lines.append(f"| {f.group} | `{f.name}` | {_cell(f.default)} | {_STATUS_WORDS[f.status]} | {note} |")
    lines += [
        "",
        f"Megatron's other flags in slime's run scripts ({len(MEGATRON_FLAGS)}; those rlcore-run parses as settings "
        "are in the Megatron backend's flag table): every one is refused under --train-backend torch.",
        "",
        "| flag | --train-backend megatron | why |",
        "| --- | --- | --- |",
    ]
    for name, entry in sorted(MEGATRON_FLAGS.items()):
        lines.append(f"| `{name}` | {'accepted' if entry.accepted else 'refused'} | {entry.reason} |")
    lines += ["", _DOC_END]
    return "\n".join(lines)


def replace_in(text: str) -> str:
    """``text`` (docs/runtime.md) with its generated table replaced by ``render_markdown()``."""
    pattern = re.compile(re.escape(_DOC_BEGIN) + ".*?" + re.escape(_DOC_END), re.S)
    if not pattern.search(text):
        raise ValueError("docs/runtime.md has no slime-flags markers")
    return pattern.sub(lambda _: render_markdown(), text)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print (or write into a markdown file) the slime flag table.")
    parser.add_argument("--write", metavar="FILE.md", help="replace the table between the markers in FILE.md")
    args = parser.parse_args(None if argv is None else list(argv))
    if args.write is None:
        print(render_markdown())
        return 0
    with open(args.write) as fh:
        text = fh.read()
    with open(args.write, "w") as fh:
        fh.write(replace_in(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
