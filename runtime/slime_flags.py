"""Every flag of slime's own argument groups, and what ``rlcore-run`` does with it: one table, read by the parser
(which flags to accept and refuse, and why) and rendered into ``docs/runtime.md`` (``python -m runtime.slime_flags
--write docs/runtime.md``; a test checks the two agree). The supported rows are generated from the config's fields
(each field's ``slime`` metadata: ``runtime.option_fields.slime``), one source for the flag, its default, help and
YAML key; the refused rows are :data:`REFUSED_FLAGS`.

Each entry is one of

- ``yes``: a field of ``runtime.config`` under slime's name, default and meaning;
- ``differs``: a field of ``runtime.config`` under slime's name whose default, values or behaviour differ as the
  note says (by design, or until the named issue lands);
- ``refused``: accepted by the parser at slime's default (so a slime script that spells the default out runs) and
  refused at validation, naming the flag and why, when set to anything else;

The facts (names, groups, defaults) come from slime's ``slime/utils/arguments.py`` and
``slime/backends/sglang_utils/arguments.py`` at 624b824a; the Megatron flags slime resets (``reset_arg``) are
listed under the group that resets them.
"""

from __future__ import annotations

import argparse
import functools
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

# slime's argument groups, in the order of its arguments.py (the table's order).
GROUPS = (
    "cluster",
    "train",
    "rollout",
    "fault_tolerance",
    "data",
    "eval",
    "algo",
    "on_policy_distillation",
    "wandb",
    "tensorboard",
    "debug",
    "network",
    "reward_model",
    "rollout_buffer",
    "custom_megatron_plugins",
    "mtp_training",
    "ci",
    "mode",
    "sglang",
    "megatron (reset by slime)",
)

# slime's flags that rlcore-run refuses away from slime's default, and why. The flags it supports are fields of the
# config, whose row (group, default, where rlcore differs) is on the field: ``runtime.option_fields.slime``.
REFUSED_FLAGS: tuple[SlimeFlag, ...] = (
    # train
    _f("--qwen-gdn-backend", "train", "fla", REFUSED, "selects a Qwen gated-delta-net kernel, a path rlcore lacks"),
    _f("--update-weight-mode", "train", "full", REFUSED, DELTA_SYNC),
    _true(
        "--release-train",
        "train",
        REFUSED,
        "kills the trainer actors after each weight sync and recreates them before the next train step, reloading "
        "them from the step's --save (slime needs full disk weight sync for it); rlcore's trainers are long-lived "
        "actors that keep their process groups, optimizer state and RNG in memory across steps",
    ),
    _f("--update-weight-delta-encoding", "train", "xor", REFUSED, DELTA_SETTING),
    _f("--update-weight-delta-checksum", "train", "xxh3-128", REFUSED, DELTA_SETTING),
    _f(
        "--update-weight-local-checkpoint-dir",
        "train",
        None,
        REFUSED,
        "engines fill it through /pull_weights, an endpoint of slime's patched SGLang that SGLang 0.5.23 lacks",
    ),
    _f(
        "--log-probs-chunk-size",
        "train",
        -1,
        REFUSED,
        "rlcore's fused log-prob kernel never materialises float32 logits and picks its own chunks",
    ),
    _true(
        "--allgather-cp",
        "train",
        REFUSED,
        "all-gathers the context-parallel sequence for DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5); "
        "rlcore builds dense Llama/Qwen models and no context parallelism (--context-parallel-size is refused)",
    ),
    # rollout
    _f(
        "--rollout-data-transport",
        "rollout",
        "object-store",
        REFUSED,
        "nixl is a hardware transport rlcore lacks; batches go through Ray's object store",
    ),
    # data
    _f("--multimodal-keys", "data", None, REFUSED, TEXT_ONLY, type=_json),
    _true("--balance-by-flops", "data", REFUSED, PACKING),
    # network
    _true(
        "--use-distributed-post",
        "network",
        REFUSED,
        "spreads SGLang HTTP posts over per-node Ray actors of a multi-node fleet; rlcore-run runs on one node and "
        "posts from the driver's event loop",
    ),
    # rollout buffer
    _f("--rollout-buffer-url", "rollout_buffer", None, REFUSED, ROLLOUT_BUFFER),
    _f("--fetch-trajectory-retry-times", "rollout_buffer", -1, REFUSED, ROLLOUT_BUFFER),
    _f("--min-batch-collection-ratio", "rollout_buffer", 1.0, REFUSED, ROLLOUT_BUFFER),
    _f("--rollout-task-type", "rollout_buffer", "math", REFUSED, ROLLOUT_BUFFER),
    _f("--data-pad-size-multiplier", "rollout_buffer", 128, REFUSED, PACKING),
    # custom Megatron plugins
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
    # SGLang (slime/backends/sglang_utils/arguments.py)
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
    _true(
        "--freeze-indexer",
        "megatron (reset by slime)",
        REFUSED,
        "freezes the indexer of DeepSeek sparse attention (DSA), a module of models rlcore does not build (dense "
        "Llama/Qwen only); --freeze-params-name-list freezes parameters by name",
    ),
    _true(
        "--async-save",
        "megatron (reset by slime)",
        REFUSED,
        "Megatron-LM's asynchronous save (megatron.training.async_utils, a background writer finalised at the next "
        "save): rlcore saves synchronously, so a checkpoint's latest pointer and manifest name only finished files",
    ),
)
PARSED_REFUSED = REFUSED_FLAGS


def supported_flags() -> tuple[SlimeFlag, ...]:
    """slime's flags that rlcore-run supports, generated from the config's fields (each field's ``slime`` row): the
    flag, slime's group and default, and ``differs`` with its note where rlcore differs from slime."""
    from runtime.config import _SPECS, flag

    rows = []
    for name, (_, f, _) in _SPECS.items():
        row = f.metadata.get("slime")
        if row is not None:
            status, note = (YES, row.note) if row.differs is None else (DIFFERS, row.differs)
            rows.append(SlimeFlag(flag(name), row.group, row.default, status, note))
    return tuple(rows)


@functools.cache
def _table() -> tuple[tuple[SlimeFlag, ...], dict[str, SlimeFlag]]:
    rows = sorted(REFUSED_FLAGS + supported_flags(), key=lambda f: (GROUPS.index(f.group), f.name))
    by_name = {f.name: f for f in rows}
    if len(by_name) != len(rows):
        raise RuntimeError("a slime flag is listed twice (refused here and a field's row)")
    return tuple(rows), by_name


def __getattr__(name: str) -> Any:
    # SLIME_FLAGS (every slime flag, by group), BY_NAME and MEGATRON_PARSED are built on first use: they come from
    # the config's fields, and the config imports this module.
    if name == "SLIME_FLAGS":
        return _table()[0]
    if name == "BY_NAME":
        return _table()[1]
    if name == "MEGATRON_PARSED":
        return _megatron_parsed()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


REFUSED_BY_DEST: dict[str, SlimeFlag] = {f.dest: f for f in PARSED_REFUSED}

# Flags slime generates or takes from Megatron, by prefix or name: refused with the issue that brings them.
_OWNED_PREFIXES = (
    ("--sglang-", "not a flag of SGLang 0.5.23's ServerArgs (runtime/engines/sglang_flags.json)"),
    ("--router-", "not a flag of sglang-router's RouterArgs (runtime/engines/sglang_flags.json)"),
)


@functools.cache
def _megatron_parsed() -> frozenset[str]:
    """Megatron's own flags that rlcore-run parses as config fields, under Megatron's names and meanings (none is in
    slime's argument groups), derived from their declarations: the Megatron backend's own
    (``megatron_options.MEGATRON_TRAIN_FIELDS``: ``MegatronOptions``' fields without a slime row), the model section's
    shape flags (``runtime.config.MODEL_SHAPE_FIELDS``, checked against config.json under any backend) and the fields
    a section declares ``megatron=True`` (Megatron's flags that the torch backend reads too, such as
    ``--recompute-granularity``). The values the Megatron backend builds are
    ``megatron_options.MEGATRON_VALUES_BUILT``'s."""
    from runtime.config import _SPECS, MODEL_SHAPE_FIELDS
    from runtime.train.backends.megatron_options import MEGATRON_TRAIN_FIELDS

    marked = (name for name, (_, f, _) in _SPECS.items() if f.metadata.get("megatron"))
    names = {*MEGATRON_TRAIN_FIELDS, *MODEL_SHAPE_FIELDS, *marked}
    return frozenset(_SPECS[name][1].metadata.get("flag", "--" + name.replace("_", "-")) for name in names)


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
FP8 = "FP8 training needs Transformer Engine, which is not installed (the local layer spec trains in bf16)"
STAGES = "the backend builds one model chunk per pipeline stage (no virtual stages)"
FRESH = (
    "rlcore's --load resumes a job whole; a torch_dist --load (or --ref-load) already starts the optimizer, RNG "
    "and step afresh, as slime does"
)
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
    "--moe-permute-fusion": MegatronFlag(
        True,
        "the backend's once-per-rank dispatcher permutes tokens by gathers (the fused permutation is Transformer "
        "Engine's): the same tokens in the same order to each expert",
    ),
    "--moe-enable-deepep": MegatronFlag(
        False,
        "DeepEP's flex dispatcher is not installed; the backend's alltoall dispatcher sends each token once per "
        "expert-parallel rank, as DeepEP does",
    ),
    **{name: MegatronFlag(False, FP8) for name in ("--fp8-format", "--fp8-recipe", "--fp8-param-gather")},
    "--num-layers-per-virtual-pipeline-stage": MegatronFlag(False, STAGES),
    **{name: MegatronFlag(False, FRESH) for name in ("--no-load-optim", "--no-load-rng", "--finetune")},
    "--spec": MegatronFlag(
        False,
        "a layer spec of slime's plugins: the backend builds megatron-core's local GPT layer spec with each family's "
        "own layers from config.json (GLM-4's post-norms included)",
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
    if name in _table()[1]:
        return f"{name}: {_table()[1][name].note}"
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
    for f in _table()[0]:
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
        f"{len(_table()[0])} flags: {c[YES]} supported as in slime, {c[DIFFERS]} supported with a difference, "
        f"{c[REFUSED]} accepted at slime's default and refused otherwise.",
        "",
        "| group | flag | slime default | rlcore-run | note |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in _table()[0]:
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
