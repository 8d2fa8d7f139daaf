"""Megatron's own flags in slime's run scripts: which ``--train-backend megatron`` accepts (``MEGATRON_FLAGS``'
switches, ``MEGATRON_VALUES_BUILT``'s values), which it refuses and why, and that the accepted ones reach
megatron-core's ``TransformerConfig`` and ``OptimizerConfig`` (built here on the CPU)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from runtime import slime_flags
from runtime.config import MEGATRON_VALUES_BUILT, ConfigError, TrainConfig, flag, parse_args
from runtime.train.backends import megatron_config as mc

pytest.importorskip("megatron.core")

QWEN3 = {
    "model_type": "qwen3",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
ACCEPTED = [name for name, entry in slime_flags.MEGATRON_FLAGS.items() if entry.accepted]
REFUSED = [name for name, entry in slime_flags.MEGATRON_FLAGS.items() if not entry.accepted]


@pytest.fixture()
def job(tmp_path):
    """A job's flags with a Qwen3 --hf-checkpoint (its config.json only) and prompt data."""
    import json

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1", "label": "2"}\n')
    return [
        "--hf-checkpoint", str(model),
        "--prompt-data", str(prompts),
        "--rm-type", "math",
        "--rollout-max-response-len", "8",
        "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2",
        "--num-rollout", "1",
        "--actor-num-gpus-per-node", "1",
    ]  # fmt: skip


MEGATRON = ["--train-backend", "megatron"]
# Named: alone, a Megatron flag selects --train-backend megatron, as slime runs (runtime.slime_compat).
TORCH = ["--train-backend", "torch"]


def _problems(argv):
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    return info.value.problems


def test_the_table_names_the_switches_the_task_accepts_and_every_entry_says_why():
    assert set(ACCEPTED) == {
        "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion",
        "--no-bias-dropout-fusion",
        "--no-rope-fusion",
        "--attention-softmax-in-fp32",
        "--use-checkpoint-opt_param-scheduler",
        "--moe-permute-fusion",
    }
    for name in ("--no-rope-fusion", "--no-masked-softmax-fusion"):
        assert "unfused anyway" in slime_flags.MEGATRON_FLAGS[name].reason
    assert all(entry.reason for entry in slime_flags.MEGATRON_FLAGS.values())
    # Flags parsed as config fields are not in the table of the others.
    assert not slime_flags.MEGATRON_PARSED & slime_flags.MEGATRON_FLAGS.keys()


@pytest.mark.parametrize("name", ACCEPTED)
def test_accepted_switches_pass_under_megatron_and_are_refused_under_torch(name, job, tmp_path):
    parse_args([*job, *MEGATRON, name])
    problems = _problems([*job, *TORCH, name])
    assert problems == [f"{name}: a Megatron flag, taken by --train-backend megatron only (torch backend)"]
    assert parse_args([*job, name]).train.train_backend == "megatron"  # inferred from the switch alone
    # The backend may come from a --config YAML file too.
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  train_backend: megatron\n")
    parse_args([*job, "--config", str(path), name])


@pytest.mark.parametrize("name", REFUSED)
@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_refused_megatron_flags_name_their_reason_under_either_backend(name, backend, job):
    problems = _problems([*job, "--train-backend", backend, name, "8"])
    reason = slime_flags.MEGATRON_FLAGS[name].reason
    assert [p for p in problems if p.startswith(name)] == [
        f"{name}: a Megatron flag rlcore's Megatron backend does not take: {reason}"
    ]


# A value each field is refused at, under --train-backend megatron.
OTHER_VALUES = {
    "attention_backend": ["fused"],
    "attention_dropout": ["0.1"],
    "hidden_dropout": ["0.1"],
    "expert_tensor_parallel_size": ["2"],
    "moe_token_dispatcher_type": ["allgather"],
    "moe_router_load_balancing_type": ["sinkhorn"],
    "moe_router_dtype": ["fp16"],
    "moe_token_drop_policy": ["random"],
}


@pytest.mark.parametrize("field", sorted(MEGATRON_VALUES_BUILT))
def test_megatron_values_built_pass_and_others_are_refused_naming_why(field, job):
    values, why = MEGATRON_VALUES_BUILT[field]
    for value in values:
        cfg = parse_args([*job, *MEGATRON, flag(field), str(value)])
        assert getattr(cfg.train, field) == value
    for text in OTHER_VALUES[field]:
        problems = _problems([*job, *MEGATRON, flag(field), text])
        assert [p for p in problems if p.startswith(flag(field))] == [
            f"{flag(field)} {type(values[0])(text)}: {why} (takes {', '.join(map(str, values))})"
        ]
        # The torch backend refuses it away from the default, naming the backend that takes it.
        assert f"{flag(field)}: a Megatron flag, used by --train-backend megatron only" in _problems(
            [*job, *TORCH, flag(field), text]
        )
    assert "Transformer Engine" in MEGATRON_VALUES_BUILT["attention_backend"][1]


def test_the_slime_scripts_values_pass_under_megatron(job):
    cfg = parse_args(
        [
            *job,
            *MEGATRON,
            "--attention-dropout", "0.0",
            "--hidden-dropout", "0.0",
            "--attention-backend", "unfused",
            "--expert-model-parallel-size", "1",
            "--expert-tensor-parallel-size", "1",
            "--deterministic-mode",
            "--use-rotary-position-embeddings",
            "--no-rope-fusion",
            "--attention-softmax-in-fp32",
        ]
    )  # fmt: skip
    assert (cfg.train.attention_backend, cfg.train.deterministic_mode) == ("unfused", True)
    assert cfg.model.use_rotary_position_embeddings is True


def test_use_rotary_position_embeddings_is_checked_against_config_json(job):
    problems = _problems([*job, *MEGATRON, "--no-use-rotary-position-embeddings"])
    assert any(
        p.startswith("--use-rotary-position-embeddings False disagrees with") and "model_type (rope) gives True" in p
        for p in problems
    ), problems
    assert mc.SHAPE_FLAGS["use_rotary_position_embeddings"][0](mc.shape_from_hf(QWEN3)) is True


def test_a_megatron_field_away_from_its_default_is_refused_once_under_torch(job):
    from runtime.train.backends.megatron_options import MEGATRON_TRAIN_FIELDS

    assert len(set(MEGATRON_TRAIN_FIELDS)) == len(MEGATRON_TRAIN_FIELDS)
    assert _problems([*job, *TORCH, "--attention-backend", "local"]) == [
        "--attention-backend: a Megatron flag, used by --train-backend megatron only"
    ]


def test_overlap_grad_reduce_and_the_bucket_size_reach_megatrons_ddp_config(job):
    cfg = parse_args([*job, *MEGATRON, "--overlap-grad-reduce", "--ddp-bucket-size", "20000"])
    assert cfg.train.overlap_grad_reduce and cfg.train.ddp_bucket_size == 20000
    defaults = parse_args([*job, *MEGATRON])
    assert not defaults.train.overlap_grad_reduce and defaults.train.ddp_bucket_size is None
    assert any(
        p.startswith("--ddp-bucket-size must be >= 1") for p in _problems([*job, *MEGATRON, "--ddp-bucket-size", "0"])
    )
    problems = _problems([*job, *TORCH, "--overlap-grad-reduce"])
    assert "--overlap-grad-reduce: a Megatron flag, used by --train-backend megatron only" in problems


def test_swiglu_fusion_is_megatrons_default_on_gpus_and_the_switch_turns_it_off(job):
    from runtime.train.backends.megatron_backend import transformer_config

    shape = mc.shape_from_hf(QWEN3)
    on = parse_args([*job, *MEGATRON]).train
    off = parse_args([*job, *MEGATRON, "--no-bias-swiglu-fusion"]).train
    assert on.bias_swiglu_fusion and not off.bias_swiglu_fusion
    assert transformer_config(shape, on, bf16=True, cpu=False).bias_activation_fusion
    assert not transformer_config(shape, off, bf16=True, cpu=False).bias_activation_fusion
    assert not transformer_config(shape, on, bf16=True, cpu=True).bias_activation_fusion  # the CPU runs it eagerly
    assert "--bias-swiglu-fusion: a Megatron flag, used by --train-backend megatron only" in _problems(
        [*job, *TORCH, "--no-bias-swiglu-fusion"]
    )


def test_cpu_optimizer_offload_flags_go_together(job):
    problems = _problems([*job, *MEGATRON, "--overlap-cpu-optimizer-d2h-h2d"])
    assert any(
        p.startswith("--overlap-cpu-optimizer-d2h-h2d overlaps the copies of --optimizer-cpu-offload")
        for p in problems
    )
    cfg = parse_args([*job, *MEGATRON, "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d"])
    assert cfg.train.optimizer_cpu_offload and cfg.train.overlap_cpu_optimizer_d2h_h2d


@pytest.mark.parametrize("bf16", [False, True])
def test_transformer_config_carries_the_megatron_flags(job, bf16):
    from megatron.core.transformer.enums import AttnBackend

    from runtime.train.backends.megatron_backend import transformer_config

    shape = mc.shape_from_hf(QWEN3)
    defaults = transformer_config(shape, TrainConfig(), bf16=bf16, cpu=True)
    assert not defaults.deterministic_mode
    cfg = parse_args(
        [
            *job,
            *MEGATRON,
            "--attention-backend", "local",
            "--deterministic-mode",
            "--attention-dropout", "0.0",
            "--hidden-dropout", "0.0",
            "--recompute-granularity", "full",
            "--recompute-method", "uniform",
            "--recompute-num-layers", "1",
            "--attention-softmax-in-fp32",
        ]
    )  # fmt: skip
    tc = transformer_config(shape, cfg.train, bf16=bf16, cpu=True)
    assert cfg.train.attention_backend == "local" and tc.deterministic_mode
    # Left at megatron-core's default: it only sets Transformer Engine's process-wide NVTE_*_ATTN variables.
    assert tc.attention_backend == AttnBackend.auto
    assert (tc.attention_dropout, tc.hidden_dropout) == (0.0, 0.0)
    assert tc.attention_softmax_in_fp32 and tc.bf16 == bf16
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "uniform", 1)
    # What the accepted --no-*-fusion switches ask for is the backend's only setting.
    assert not any(
        (
            tc.gradient_accumulation_fusion,
            tc.masked_softmax_fusion,
            tc.bias_activation_fusion,
            tc.bias_dropout_fusion,
            tc.apply_rope_fusion,
        )
    )
    assert (tc.num_layers, tc.hidden_size, tc.num_query_groups) == (2, 64, 2)


def test_sequence_parallel_is_off_at_tp1_and_built_at_tp2(job):
    """Off at TP 1 as Megatron-LM turns it off there (slime's scripts pass it anyway); built at TP 2 (the norms that
    take it: tests/test_megatron_sequence_parallel.py)."""
    from runtime.train.backends.megatron_backend import transformer_config

    shape = mc.shape_from_hf(QWEN3)
    at_tp1 = parse_args([*job, *MEGATRON, "--sequence-parallel"])
    assert at_tp1.train.sequence_parallel  # as given, and accepted
    assert not transformer_config(shape, at_tp1.train, bf16=False, cpu=True).sequence_parallel
    at_tp2 = parse_args(
        [*job, *MEGATRON, "--sequence-parallel", "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"]
    )
    assert transformer_config(shape, at_tp2.train, bf16=False, cpu=True).sequence_parallel
    plain_tp2 = parse_args([*job, *MEGATRON, "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"])
    assert not transformer_config(shape, plain_tp2.train, bf16=False, cpu=True).sequence_parallel


def test_optimizer_config_carries_the_cpu_offload_flags(job):
    from runtime.train.backends.megatron_backend import optimizer_config

    plain = optimizer_config(TrainConfig(), bf16=True)
    assert not plain.optimizer_cpu_offload and plain.optimizer_offload_fraction == 0.0
    cfg = parse_args(
        [
            *job,
            *MEGATRON,
            "--optimizer-cpu-offload",
            "--overlap-cpu-optimizer-d2h-h2d",
            "--adam-beta2", "0.98",
            "--lr", "2e-6",
            "--weight-decay", "0.1",
        ]
    )  # fmt: skip
    oc = optimizer_config(cfg.train, bf16=True)
    assert oc.optimizer_cpu_offload and oc.optimizer_offload_fraction == 1.0 and oc.overlap_cpu_optimizer_d2h_h2d
    assert (oc.adam_beta2, oc.lr, oc.weight_decay, oc.use_distributed_optimizer) == (0.98, 2e-6, 0.1, True)
    assert oc.bf16 and oc.params_dtype == torch.float32


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine present")
def test_precision_aware_optimizer_needs_transformer_engine_in_megatron_core():
    """The refusal's reason, checked against megatron-core itself: its OptimizerConfig fails without TE."""
    from megatron.core.optimizer import OptimizerConfig

    for offload in (False, True):
        with pytest.raises((RuntimeError, TypeError)):
            OptimizerConfig(
                optimizer="adam",
                lr=1e-6,
                use_distributed_optimizer=True,
                use_precision_aware_optimizer=True,
                optimizer_cpu_offload=offload,
            )
    assert "Transformer Engine" in slime_flags.MEGATRON_FLAGS["--use-precision-aware-optimizer"].reason


def test_the_megatron_trainer_refuses_cpu_optimizer_offload_on_the_cpu(job):
    from rlcore.losses import LossConfig
    from runtime.train.backends.megatron_backend import MegatronTrainer

    cfg = parse_args([*job, *MEGATRON, "--optimizer-cpu-offload"])
    with pytest.raises(ValueError, match="--optimizer-cpu-offload runs on GPUs only"):
        MegatronTrainer(
            cfg.model.hf_checkpoint,
            train_cfg=cfg.train,
            loss_cfg=LossConfig(),
            temperature=1.0,
            seed=0,
            device="cpu",
        )


def test_the_flags_reach_the_megatron_trainers_model_and_schedule(tmp_path):
    """Through the backend itself (a tiny Qwen3 on the CPU): the model's TransformerConfig carries the flags, and
    the LR schedule takes its values from a checkpoint (--use-checkpoint-opt_param-scheduler)."""
    from megatron.core.transformer.enums import AttnBackend
    from test_megatron_backend import job as backend_job
    from test_megatron_backend import save_model, trainer

    path = save_model("qwen3", tmp_path / "qwen3")
    cfg = backend_job(
        tmp_path, train_backend="megatron", attention_backend="unfused", deterministic_mode=True, hidden_dropout=0.0
    )
    mega = trainer("megatron", path, cfg)
    try:
        gpt = mega._module(mega.model)
        config = gpt.config
        assert config.deterministic_mode and gpt.embedding.word_embeddings.deterministic_mode
        # Transformer Engine's variables are left alone (megatron-core sets them from auto, as before).
        assert config.attention_backend == AttnBackend.auto
        assert (config.hidden_dropout, config.attention_dropout, config.attention_softmax_in_fp32) == (0.0, 0.0, True)
        assert mega.scheduler.use_checkpoint_opt_param_scheduler
    finally:
        mega.shutdown()
