"""slime's hook surface, called the way slime calls it, by the hooks of ``tests/fixtures/slime_style_plugin.py``
(written as a slime user writes them). Engines are in-process fakes; the loss math is checked in float64."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from rlcore import keys
from rlcore.losses import LossConfig, rl_loss
from runtime.config import RewardConfig
from runtime.engines import SamplingParams
from runtime.engines.base import Generation
from runtime.hooks import HookFailure, resolve_hook
from runtime.rollout import RolloutContext, collect_rollout, expand_groups, generate_groups
from runtime.rollout.rewards import RewardHub
from runtime.rollout.sample import Sample
from runtime.train.batch import ROLLOUT_INDEX, build_batch, shard_rollouts, shard_rows

PLUGIN = "tests/fixtures/slime_style_plugin.py"


@pytest.fixture
def plugin():
    hook = resolve_hook("--custom-generate-function-path", f"{PLUGIN}:generate_fan_out")
    module = __import__(hook.fn.__module__)
    module.CALLS.clear()
    return module


def hook(flag: str, name: str):
    return resolve_hook(flag, f"{PLUGIN}:{name}")


class _Tokenizer:
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "ok"


class _Engines:
    """Every prompt gets the response [1, 2, 3] with log-probs -0.1, -0.2, -0.3."""

    def rewind(self):
        pass

    async def generate(self, prompts, params, *, session_ids=None):
        return [Generation(token_ids=[1, 2, 3], log_probs=[-0.1, -0.2, -0.3], finish_reason="stop") for _ in prompts]


def _prompts():
    counter = iter(range(1000))
    return lambda n: [Sample(index=k, tokens=[k + 10], label="ok") for k in (next(counter) for _ in range(n))]


def _collect(*, custom_generate=None, sample_hooks=(), n_samples=2, rollout_batch_size=2, rollout_id=7):
    ctx = RolloutContext(
        engines=_Engines(), tokenizer=_Tokenizer(), args=SimpleNamespace(), sample_hooks=tuple(sample_hooks)
    )
    hub = RewardHub(RewardConfig(rm_type="exact_match"))
    try:
        return asyncio.run(
            collect_rollout(
                ctx,
                _prompts(),
                hub,
                rollout_batch_size=rollout_batch_size,
                n_samples=n_samples,
                params=SamplingParams(4),
                custom_generate=custom_generate,
                rollout_id=rollout_id,
            )
        )
    finally:
        hub.close()


# ---------------------------------------------------------------- custom generate: fan-out and evaluation


def test_fan_out_samples_share_their_group_and_a_rollout_id(plugin):
    gen = hook("--custom-generate-function-path", "generate_fan_out")
    samples, metrics, _ = _collect(custom_generate=gen)
    # 2 prompts x 2 samples x 2 pieces, in group order, scored one by one.
    assert len(samples) == 8 and [s.group_index for s in samples] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [s.response_length for s in samples] == [1, 2] * 4
    ids = [s.rollout_id for s in samples]
    assert ids[0] == ids[1] and ids[2] == ids[3] and len(set(ids)) == 4
    assert all(s.reward == 1.0 for s in samples) and metrics["reward/num_scored"] == 8
    assert {c["evaluation"] for c in plugin.CALLS["generate"]} == {False}
    batch = build_batch(samples, pad_token_id=0)
    assert batch[ROLLOUT_INDEX].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert batch[keys.SEQ_TOKEN_COUNTS].tolist() == [3] * 8
    assert batch[keys.SEQ_COUNTS].tolist() == [1, 0] * 4


def test_evaluation_keyword_reaches_a_generate_function_that_names_it(plugin):
    gen = hook("--custom-generate-function-path", "generate_fan_out")
    ctx = RolloutContext(engines=_Engines(), tokenizer=_Tokenizer(), args=SimpleNamespace())
    groups = expand_groups(_prompts()(2), 1, first_group=0)
    whole, aborted = asyncio.run(generate_groups(ctx, groups, SamplingParams(4), gen))
    assert not aborted and [len(g) for g in whole] == [2, 2]
    assert [c["evaluation"] for c in plugin.CALLS["generate"]] == [True, True]

    async def without_keyword(args, sample, sampling_params):  # slime passes evaluation only when it is named
        sample.tokens, sample.response_length, sample.loss_mask = [*sample.tokens, 4], 1, [1]
        return sample

    samples, _, _ = _collect(custom_generate=without_keyword)
    assert len(samples) == 4


def test_fan_out_loss_divides_each_token_sum_by_its_rollouts_mask_in_float64():
    """slime's default reducer (``get_sum_of_sample_mean`` with ``rollout_mask_sums``): a row's masked token sum over
    the total mask of its rollout, summed, over the number of rollouts; checked by hand in float64, gradient too."""
    g = torch.Generator().manual_seed(0)
    pieces = []
    # Rollouts: A = 2 pieces (3 + 2 tokens, one masked tool token), B = one sample, C = 3 pieces; one piece removed.
    shape = {"A": [(3, [1, 0, 1]), (2, [1, 1])], "B": [(4, [1, 1, 1, 1])], "C": [(1, [1]), (2, [1, 1]), (2, [0, 1])]}
    for gi, (name, parts) in enumerate(shape.items()):
        for r, mask in parts:
            s = Sample(group_index=gi, index=gi, tokens=[5] * 2 + [7] * r, response_length=r, loss_mask=mask)
            s.reward, s.rollout_id = 1.0, None if name == "B" else 100 + gi
            pieces.append(s)
    pieces[3].remove_sample = True  # C's first piece leaves the loss, not the denominators
    batch = build_batch(pieces, pad_token_id=0)
    B, T = batch[keys.MASK].shape
    log_probs = torch.randn(B, T, generator=g, dtype=torch.float64).requires_grad_()
    batch.set(keys.LOG_PROBS, log_probs)
    batch.set(keys.OLD_LOG_PROBS, log_probs.detach())
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    batch.set(keys.ADVANTAGES, adv)
    loss, _ = rl_loss(batch, LossConfig(loss_agg_mode="seq_mean_token_mean"))

    masks = [([0] * s.response_length if s.remove_sample else s.loss_mask) for s in pieces]
    rollout = [100, 100, "B", 101, 101, 101]  # removal zeroes C's first piece before its rollout's sum
    totals = {rid: sum(sum(m) for m, r in zip(masks, rollout, strict=True) if r == rid) for rid in set(rollout)}
    want = 0.0
    grad = torch.zeros(B, T, dtype=torch.float64)
    for i, (m, rid) in enumerate(zip(masks, rollout, strict=True)):
        for t, keep in enumerate(m):
            if keep:
                # On-policy ratio 1: the clipped surrogate is -A per token, with gradient -A.
                want += -float(adv[i, t]) / max(totals[rid], 1) / len(totals)
                grad[i, t] = -float(adv[i, t]) / max(totals[rid], 1) / len(totals)
    assert totals == {100: 4, "B": 4, 101: 3}
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12)
    (got,) = torch.autograd.grad(loss, log_probs)
    torch.testing.assert_close(got, grad)


def test_steps_and_shards_hold_whole_rollouts():
    index = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 5, 5, 6, 7])
    rows0, steps0 = shard_rollouts(index, global_batch_size=4, dp_rank=0, dp_size=2)
    rows1, steps1 = shard_rollouts(index, global_batch_size=4, dp_rank=1, dp_size=2)
    assert rows0.tolist() == [0, 1, 2, 7, 8, 9] and steps0 == [3, 3]
    assert rows1.tolist() == [3, 4, 5, 6, 10, 11] and steps1 == [4, 2]
    plain = torch.arange(8)
    assert (
        shard_rollouts(plain, global_batch_size=4, dp_rank=1, dp_size=2)[0].tolist()
        == shard_rows(8, global_batch_size=4, dp_rank=1, dp_size=2).tolist()
    )


def test_bad_fan_out_is_named_by_flag_and_file():
    gen_flag = "--custom-generate-function-path"

    async def mixed(args, sample, sampling_params):
        a, b = Sample(tokens=[1, 2], response_length=1), Sample(tokens=[1, 3], response_length=1)
        a.rollout_id, b.rollout_id = 1, 2
        return [a, b]

    from runtime.hooks import Hook

    with pytest.raises(HookFailure, match=f"{gen_flag} x.py:mixed: returned 2 samples .* different rollout_ids"):
        _collect(custom_generate=Hook(gen_flag, "x.py:mixed", mixed))

    async def not_samples(args, sample, sampling_params):
        return [sample, "text"]

    with pytest.raises(HookFailure, match="returned a list holding str"):
        _collect(custom_generate=Hook(gen_flag, "x.py:f", not_samples))


# ---------------------------------------------------------------- --rollout-sample-hook-path


def test_sample_hooks_run_in_order_on_every_sample_with_the_keywords_they_name(plugin):
    hooks = [hook("--rollout-sample-hook-path", "tag_sample"), hook("--rollout-sample-hook-path", "count_sample")]
    samples, _, _ = _collect(sample_hooks=hooks, rollout_id=7)
    assert all(s.metadata["tagged"] for s in samples)
    assert plugin.CALLS["tag"] == [{"rollout_id": 7, "evaluation": False}] * 4
    assert len(plugin.CALLS["count"]) == 4
    gen = hook("--custom-generate-function-path", "generate_fan_out")
    samples, _, _ = _collect(custom_generate=gen, sample_hooks=hooks)
    assert len(plugin.CALLS["tag"]) == 4 + 8  # every piece of a fan-out

    def bad(args, sample):
        return 3

    from runtime.hooks import Hook

    with pytest.raises(HookFailure, match="--rollout-sample-hook-path b.py:bad: returned int 3, expected a Sample"):
        _collect(sample_hooks=[Hook("--rollout-sample-hook-path", "b.py:bad", bad)])


# ---------------------------------------------------------------- trainer-side hooks (in-process trainers)

from runtime.config import from_dict, validate  # noqa: E402
from runtime.demo import task  # noqa: E402
from runtime.demo.tiny_model import make_tiny_model  # noqa: E402
from runtime.train.algo import advantage_config, loss_config, model_roles  # noqa: E402
from runtime.train.backends.torch_backend import TorchTrainer  # noqa: E402
from runtime.train.hooks import train_hooks  # noqa: E402
from runtime.train.step import train_rollout  # noqa: E402

SMALL = {"rollout_batch_size": 2, "n_samples_per_prompt": 4, "global_batch_size": 8, "micro_batch_size": 2}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), alphabet=task.ALPHABET, seed=0))


def _cfg(tmp_path, **overrides):
    # slime's RL defaults (per-sample means), rewards as advantages so that the policy loss is not 0 by symmetry.
    settings = {
        **SMALL,
        "lr": 1e-2,
        "calculate_per_token_loss": False,
        "disable_rewards_normalization": True,
        **overrides,
    }
    return validate(from_dict(None, output_dir=str(tmp_path / "out"), **settings))


def _plugin_paths(**names):
    return {flag: f"{PLUGIN}:{fn}" for flag, fn in names.items()}


def _batch(model_path, *, fan_out=False, seed=0):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, rec in enumerate(task.make_records(8, seed=seed)):
        prompt = tokenizer(rec["prompt"])["input_ids"]
        pieces = 2 if fan_out and i % 2 else 1
        for _ in range(pieces):
            response = torch.randint(
                4, len(tokenizer), (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen
            )
            s = Sample(index=i, group_index=i // 4, tokens=prompt + response.tolist(), response_length=len(response))
            s.reward, s.rollout_id = float(i % 3) / 2, (100 + i if pieces > 1 else None)
            s.loss_mask = [int(x) for x in (torch.rand(len(response), generator=gen) < 0.8)]
            s.loss_mask[0] = 1
            samples.append(s)

    return samples, build_batch(samples, pad_token_id=tokenizer.pad_token_id)


def _run(model_path, cfg, batch, *, rollout_id=3):
    """One rollout's training of a fresh trainer (seeded alike) through train_rollout, as a trainer actor runs it;
    returns (metrics, the trainer)."""
    from rlcore.advantages import sequence_advantages

    hooks = train_hooks(cfg)
    trainer = TorchTrainer(
        model_path,
        train_cfg=cfg.train,
        loss_cfg=loss_config(cfg),
        temperature=1.0,
        seed=0,
        roles=model_roles(cfg),
        hooks=hooks,
    )
    adv_cfg = advantage_config(cfg)
    metrics = train_rollout(
        trainer,
        sequence_advantages(batch, adv_cfg),
        global_batch_size=cfg.train.global_batch_size,
        adv_cfg=adv_cfg,
        rollout_id=rollout_id,
        hooks=hooks,
        resolved=hooks.resolve(),
    )
    return metrics, trainer


def _weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("fan_out", [False, True])
def test_custom_loss_and_pg_reducer_reproduce_the_policy_loss(model_path, tmp_path, plugin, fan_out):
    """slime's on-policy surrogate written as a custom loss, and slime's per-sample reducer given as a custom
    reducer, train to the same weights as the built-in policy loss (fan-out rows included)."""
    _, batch = _batch(model_path, fan_out=fan_out)
    base, trainer = _run(model_path, _cfg(tmp_path), batch)
    want = _weights(trainer)
    custom_cfg = _cfg(
        tmp_path,
        loss_type="custom_loss",
        **_plugin_paths(custom_loss_function_path="pg_loss_as_custom_loss"),
    )
    custom, trainer = _run(model_path, custom_cfg, batch)
    assert custom["loss"] == pytest.approx(base["pg_loss"], rel=1e-5, abs=1e-7)
    assert custom["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-5)
    # (AdamW's first step moves every weight by about lr: float32 noise on a near-zero gradient shows up to ~1e-5.)
    for name, value in _weights(trainer).items():
        torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-4)
    assert plugin.CALLS["custom_loss"][0]["logits_shape"][0] == 1
    assert {"advantages", "log_probs", "loss_masks", "rollout_mask_sums", "unconcat_tokens"} <= set(
        plugin.CALLS["custom_loss"][0]["keys"]
    )
    reducer_cfg = _cfg(tmp_path, **_plugin_paths(custom_pg_loss_reducer_function_path="sample_mean_reducer"))
    reduced, trainer = _run(model_path, reducer_cfg, batch)
    if not fan_out:  # slime's plain reducer divides by each row's own mask, not its rollout's
        assert reduced["pg_loss"] == pytest.approx(base["pg_loss"], rel=1e-5, abs=1e-7)
        assert reduced["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-5)
        for name, value in _weights(trainer).items():
            torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-4)
    assert plugin.CALLS["reducer"][0] == {"per_token": False, "n": 2}


def test_custom_advantages_and_rollout_data_postprocess(model_path, tmp_path, plugin):
    """The advantage hook's per-sample tensors become the advantages trained on; the postprocess hook sees them."""
    samples, batch = _batch(model_path)
    cfg = _cfg(
        tmp_path,
        **_plugin_paths(
            custom_advantage_function_path="advantages_are_rewards",
            rollout_data_postprocess_path="postprocess_rollout_data",
        ),
    )
    seen = {}
    hooks = train_hooks(cfg)

    class Recording(TorchTrainer):
        def train(self, td, **kwargs):
            seen["td"] = td
            return super().train(td, **kwargs)

    trainer = Recording(
        model_path,
        train_cfg=cfg.train,
        loss_cfg=loss_config(cfg),
        temperature=1.0,
        seed=0,
        roles=model_roles(cfg),
        hooks=hooks,
    )
    adv_cfg = advantage_config(cfg)
    from rlcore.advantages import sequence_advantages

    train_rollout(
        trainer,
        sequence_advantages(batch, adv_cfg),
        global_batch_size=8,
        adv_cfg=adv_cfg,
        rollout_id=5,
        hooks=hooks,
        resolved=hooks.resolve(),
    )
    td = seen["td"]
    # The hook set A = rollout_data["rewards"], the group-normalised rewards slime hands it, on every response token.
    want = batch[keys.SEQUENCE_ADVANTAGES] if keys.SEQUENCE_ADVANTAGES in batch.keys() else batch[keys.REWARDS]
    for i, r in enumerate(batch["response_lengths"].tolist()):
        torch.testing.assert_close(td[keys.ADVANTAGES][i, :r], want[i].expand(r).float())
    assert {"kl", "log_probs", "rewards", "raw_reward", "loss_masks", "response_lengths", "total_lengths"} <= set(
        plugin.CALLS["advantage"][0]["keys"]
    )
    assert plugin.CALLS["postprocess"][0]["rollout_id"] == 5
    assert "advantages" in plugin.CALLS["postprocess"][0]["keys"]


def test_backend_hooks_get_slimes_arguments(model_path, tmp_path, plugin):
    _, batch = _batch(model_path)
    cfg = _cfg(
        tmp_path,
        use_kl_loss=True,
        global_batch_size=4,
        **_plugin_paths(
            custom_megatron_init_path="on_init",
            custom_megatron_before_log_prob_hook_path="before_log_prob",
            custom_megatron_before_train_step_hook_path="before_train_step",
        ),
    )
    _run(model_path, cfg, batch, rollout_id=4)
    assert plugin.CALLS["init"] == [{"lr": 1e-2}]
    assert [c["store_prefix"] for c in plugin.CALLS["before_log_prob"]] == ["", "ref_"]
    steps = plugin.CALLS["before_train_step"]
    assert [(c["rollout_id"], c["step_id"]) for c in steps] == [(4, 0), (4, 1)]
    assert all(c["model"] and c["optimizer"] == "AdamW" and c["scheduler"] is None for c in steps)


@pytest.mark.parametrize(
    ("setting", "pattern"),
    [("only_train_params_name_list", [r"layers\.0\."]), ("freeze_params_name_list", ["embed", r"layers\.0\."])],
)
def test_param_freezing_by_regex(model_path, tmp_path, setting, pattern):
    import re

    _, batch = _batch(model_path)
    cfg = _cfg(tmp_path, **{setting: pattern})
    hooks = train_hooks(cfg)
    trainer = TorchTrainer(
        model_path,
        train_cfg=cfg.train,
        loss_cfg=loss_config(cfg),
        temperature=1.0,
        seed=0,
        roles=model_roles(cfg),
        hooks=hooks,
    )
    before = _weights(trainer)
    adv_cfg = advantage_config(cfg)
    from rlcore.advantages import sequence_advantages

    train_rollout(trainer, sequence_advantages(batch, adv_cfg), global_batch_size=8, adv_cfg=adv_cfg, hooks=hooks)
    matched = {n for n in before if any(re.search(p, n) for p in pattern)}
    assert matched and matched != set(before)
    for name, value in _weights(trainer).items():
        changed = not torch.equal(value, before[name])
        assert changed == ((name in matched) == (setting == "only_train_params_name_list")), name
    assert len(trainer.optimizer.param_groups[0]["params"]) == sum(p.requires_grad for p in trainer.model.parameters())


# ---------------------------------------------------------------- errors name the flag and the file, at validation

HOOK_FLAGS = [
    "--rollout-function-path",
    "--eval-function-path",
    "--data-source-path",
    "--rollout-sample-hook-path",
    "--buffer-filter-path",
    "--rollout-sample-filter-path",
    "--rollout-all-samples-process-path",
    "--rollout-data-postprocess-path",
    "--custom-reward-post-process-path",
    "--custom-convert-samples-to-train-data-path",
    "--custom-advantage-function-path",
    "--custom-pg-loss-reducer-function-path",
    "--custom-rollout-log-function-path",
    "--custom-eval-rollout-log-function-path",
    "--custom-megatron-init-path",
    "--custom-megatron-before-log-prob-hook-path",
    "--custom-megatron-before-train-step-hook-path",
]


@pytest.mark.parametrize("flag", HOOK_FLAGS)
def test_every_hook_flag_is_resolved_at_validation_naming_flag_and_path(flag, tmp_path):
    from runtime.config import ConfigError, parse_args

    base = ["--output-dir", str(tmp_path)]
    with pytest.raises(ConfigError) as info:
        parse_args([*base, flag, f"{PLUGIN}:no_such_function"])
    assert any(
        p.startswith(f"{flag} {PLUGIN}:no_such_function: ") and "has no function" in p for p in info.value.problems
    )
    with pytest.raises(ConfigError, match=f"{flag} missing_dir/x.py:f: file .* does not exist"):
        parse_args([*base, flag, "missing_dir/x.py:f"])
    parse_args([*base, flag, f"{PLUGIN}:tag_sample"])  # an existing function is accepted


def test_hook_combinations_are_checked(tmp_path):
    from runtime.config import ConfigError, parse_args

    base = ["--output-dir", str(tmp_path)]
    cases = {
        ("--loss-type", "custom_loss"): "--loss-type custom_loss needs --custom-loss-function-path",
        (
            "--custom-loss-function-path",
            f"{PLUGIN}:pg_loss_as_custom_loss",
        ): "takes effect with --loss-type custom_loss",
        ("--disable-compute-advantages-and-returns",): "leaves --loss-type policy_loss without advantages",
        ("--only-train-params-name-list", "a", "--freeze-params-name-list", "b"): "give one of them",
        ("--freeze-params-name-list", "(unclosed"): "--freeze-params-name-list '(unclosed': not a regular expression",
        ("--rollout-function-path", f"{PLUGIN}:generate_rollout", "--fully-async"): "use --rollout-schedule sync",
        ("--disable-rollout-global-dataset",): "leaves the built-in rollout no prompts",
        ("--custom-tis-function-path", f"{PLUGIN}:vanilla_tis"): "with --use-tis or --get-mismatch-metrics only",
        ("--use-rollout-entropy", "--train-backend", "megatron"): "built for --train-backend torch only",
    }
    for extra, message in cases.items():
        with pytest.raises(ConfigError) as info:
            parse_args([*base, *extra])
        assert any(message in p for p in info.value.problems), (extra, info.value.problems)
    # slime's default paths are accepted and mean the built-in rollout and data source.
    cfg = parse_args(
        [
            *base,
            "--rollout-function-path",
            "slime.rollout.sglang_rollout.generate_rollout",
            "--data-source-path",
            "slime.rollout.data_source.RolloutDataSourceWithBuffer",
            "--rollout-sample-hook-path",
            f"{PLUGIN}:tag_sample",
            "--rollout-sample-hook-path",
            f"{PLUGIN}:count_sample",
        ]
    )
    from runtime.rollout.plugins import load_rollout_hooks

    hooks = load_rollout_hooks(cfg)
    assert hooks.rollout_fn is None and hooks.data_source_cls is None and hooks.eval_fn is None
    assert [h.path for h in hooks.sample_hooks] == [f"{PLUGIN}:tag_sample", f"{PLUGIN}:count_sample"]
    assert cfg.rollout_global_dataset and cfg.rewards_normalization and cfg.compute_advantages_and_returns


def test_sample_has_slimes_fields_status_values_and_helpers():
    from dataclasses import fields

    names = {f.name for f in fields(Sample)}
    slime_fields = {
        "group_index", "index", "rollout_id", "prompt", "tokens", "multimodal_inputs", "multimodal_train_inputs",
        "multimodal_train_input_id", "apply_chat_template_kwargs", "response", "response_length", "label", "reward",
        "loss_mask", "weight_versions", "rollout_log_probs", "rollout_top_p_token_ids", "rollout_top_p_token_offsets",
        "rollout_routed_experts", "remove_sample", "teacher_log_probs", "status", "metadata", "generate_function_path",
        "custom_rm_path", "train_metadata", "session_id", "non_generation_time", "spec_info", "prefix_cache_info",
    }  # fmt: skip
    assert slime_fields <= names
    assert [s.value for s in Sample.Status] == ["pending", "completed", "truncated", "aborted", "failed"]
    s = Sample(tokens=[1, 2], reward={"acc": 1.0, "score": 0.5})
    s.append_response_tokens(tokens=[5, 6], log_probs=[-0.1, -0.2])
    s.append_response_tokens(tokens=[7], trainable=False, text="x")
    s.append_response_tokens(tokens=[8], log_probs=[-0.3], meta_info={"finish_reason": {"type": "length"}})
    assert s.tokens == [1, 2, 5, 6, 7, 8] and s.response_length == 4 and s.loss_mask == [1, 1, 0, 1]
    assert s.rollout_log_probs == [-0.1, -0.2, 0.0, -0.3] and s.status == Sample.Status.TRUNCATED
    assert s.effective_response_length == 3 and s.get_reward_value(SimpleNamespace(reward_key="acc")) == 1.0
    with pytest.raises(ValueError, match="need their rollout log-probs"):
        s.append_response_tokens(tokens=[9])
    back = Sample.from_dict(s.to_dict())
    assert back == s and back.status == Sample.Status.TRUNCATED


# ---------------------------------------------------------------- --custom-tis-function-path, --use-rollout-entropy


def _with_rollout_log_probs(model_path, *, seed=1):
    """``_batch``'s samples with engine log-probs about the tiny model's own (-ln 18 per token), spread so that the
    train/rollout ratios fall on both sides of the TIS bounds."""
    from transformers import AutoTokenizer

    samples, _ = _batch(model_path)
    gen = torch.Generator().manual_seed(seed)
    for s in samples:
        s.rollout_log_probs = (-2.9 + 0.8 * torch.randn(s.response_length, generator=gen)).tolist()
    return build_batch(samples, pad_token_id=AutoTokenizer.from_pretrained(model_path).pad_token_id)


def test_custom_tis_written_as_slimes_vanilla_tis_trains_as_the_built_in_tis(model_path, tmp_path, plugin):
    batch = _with_rollout_log_probs(model_path)
    base, trainer = _run(model_path, _cfg(tmp_path, use_tis=True), batch)
    want = _weights(trainer)
    cfg = _cfg(tmp_path, use_tis=True, **_plugin_paths(custom_tis_function_path="vanilla_tis"))
    custom, trainer = _run(model_path, cfg, batch)
    assert 0.3 < base["tis_weight_mean"] < 1.9  # the clip acts on some tokens
    assert custom["pg_loss"] == pytest.approx(base["pg_loss"], rel=1e-5, abs=1e-7)
    assert custom["tis"] == pytest.approx(base["tis_weight_mean"], rel=1e-5)
    assert custom["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-5)
    for name, value in _weights(trainer).items():
        torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-4)


def test_custom_tis_rejections_leave_the_numerators_not_the_denominators_float64(plugin):
    """slime's rule: the returned masks rebuild the numerators of the policy (and KL) terms while each sample's
    denominator stays its original mask sum; the metrics are taken over the original masks."""
    from tensordict import TensorDict

    from runtime.train.hooks import custom_tis

    gen = torch.Generator().manual_seed(0)
    lengths = [6, 3, 5, 1]
    b, t = len(lengths), max(lengths)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, r in enumerate(lengths):
        mask[i, :r] = torch.rand(r, generator=gen) > 0.2
        mask[i, 0] = True
    log_probs = (-1.5 + 0.5 * torch.randn(b, t, generator=gen, dtype=torch.float64)).requires_grad_()
    old = log_probs.detach() + 0.1 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    rollout = old + 1.2 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(b, 1, generator=gen, dtype=torch.float64).expand(b, t)
    td = TensorDict(
        {
            keys.MASK: mask,
            keys.LOG_PROBS: log_probs,
            keys.OLD_LOG_PROBS: old,
            keys.ROLLOUT_LOG_PROBS: rollout,
            keys.REF_LOG_PROBS: ref,
            keys.ADVANTAGES: adv,
        },
        batch_size=[b],
    )
    cfg = LossConfig(
        use_tis=True,
        use_kl_loss=True,
        kl_loss_coef=0.3,
        kl_loss_type="low_var_kl",
        loss_agg_mode="seq_mean_token_mean",
    )
    mismatch = custom_tis(
        hook("--custom-tis-function-path", "icepop_tis"),
        SimpleNamespace(),
        response_lengths=lengths,
        total_lengths=[r + 3 for r in lengths],
    )
    loss, metrics = rl_loss(td, cfg, mismatch=mismatch)
    assert plugin.CALLS["tis"] == [{"n": 4, "total_lengths": [9, 6, 8, 4], "response_lengths": lengths}]

    weight = torch.exp(old - rollout)
    inside = (weight >= 0.5) & (weight <= 2.0)
    ratio = torch.exp(log_probs - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * torch.where(inside, weight, 0.0)
    kl_ratio = torch.exp(ref - log_probs)
    kl = (kl_ratio - (ref - log_probs) - 1).clamp(-10, 10)  # low_var_kl
    keep = (mask & inside).double()
    denominators = mask.double().sum(1)
    want = ((pg * keep).sum(1) / denominators).mean() + 0.3 * ((kl * keep).sum(1) / denominators).mean()
    assert 0 < int(keep.sum()) < int(mask.sum())  # some valid tokens are rejected
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    (got_grad,) = torch.autograd.grad(loss, log_probs, retain_graph=True)
    (want_grad,) = torch.autograd.grad(want, log_probs)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    assert float(metrics["tis_inside"]) == pytest.approx(float((mask & inside).sum()) / float(mask.sum()), rel=1e-12)


def test_a_tis_hook_returning_the_wrong_shape_is_named(model_path, tmp_path, plugin):
    from runtime.train.hooks import custom_tis

    bad = resolve_hook("--custom-tis-function-path", f"{PLUGIN}:on_init")  # fn(args): not slime's TIS signature
    mismatch = custom_tis(bad, SimpleNamespace(), response_lengths=[2], total_lengths=[3])
    with pytest.raises(HookFailure, match="--custom-tis-function-path"):
        mismatch(
            pg=torch.zeros(1, 2),
            train_log_probs=torch.zeros(1, 2),
            rollout_log_probs=torch.zeros(1, 2),
            mask=torch.ones(1, 2, dtype=torch.bool),
        )


def test_use_rollout_entropy_hands_the_actor_and_reference_entropies_to_the_hooks(model_path, tmp_path, plugin):
    """rollout_data["entropy"] and ["ref_entropy"] (slime's store prefixes) equal a float64 entropy of the model's
    own distribution over each response token; the advantage hook builds its mask from them."""
    from transformers import AutoModelForCausalLM

    samples, batch = _batch(model_path)
    cfg = _cfg(
        tmp_path,
        use_rollout_entropy=True,
        use_kl_loss=True,
        **_plugin_paths(custom_advantage_function_path="high_entropy_advantages"),
    )
    metrics, _ = _run(model_path, cfg, batch)
    assert metrics["loss"] == metrics["loss"]  # trained, finite
    (seen,) = plugin.CALLS["entropy"]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    for s, entropy, ref_entropy in zip(samples, seen["entropy"], seen["ref_entropy"], strict=True):
        prompt = len(s.tokens) - s.response_length
        with torch.no_grad():
            logits = model(torch.tensor([s.tokens])).logits[0, prompt - 1 : len(s.tokens) - 1]
        want = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        torch.testing.assert_close(entropy.double(), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ref_entropy.double(), want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- --custom-convert-samples-to-train-data-path,
# ---------------------------------------------------------------- --buffer-filter-path


def test_convert_samples_to_train_data_builds_the_batch_trained_on(model_path, tmp_path, plugin):
    from rlcore.advantages import sequence_advantages
    from runtime.rollout.plugins import RolloutHooks
    from runtime.train.driver import rollout_batch

    samples, plain = _batch(model_path)
    cfg = _cfg(tmp_path, disable_rewards_normalization=False)  # (GRPO's group normalisation, which the hook skips)
    hooks = RolloutHooks(convert_samples=hook("--custom-convert-samples-to-train-data-path", "convert_to_train_data"))
    batch = rollout_batch(cfg, samples, _Tokenizer(), advantage_config(cfg), hooks)
    assert plugin.CALLS["convert"] == [{"n": len(samples)}]
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    torch.testing.assert_close(batch[keys.REWARDS].double(), rewards - rewards.mean(), rtol=0, atol=1e-6)
    assert batch[keys.GROUP_IDS].tolist() == [s.group_index for s in samples]
    lengths = [s.response_length for s in samples]
    assert batch[keys.MASK].sum(1).tolist() == [r - 1 for r in lengths]  # the hook's loss masks, not the samples'
    # Its rewards are final: the sequence advantage is the reward itself, not group-normalised again.
    want = sequence_advantages(plain.set(keys.REWARDS, batch[keys.REWARDS]), advantage_config(cfg))
    assert not torch.allclose(want[keys.SEQUENCE_ADVANTAGES], batch[keys.SEQUENCE_ADVANTAGES])
    torch.testing.assert_close(batch[keys.SEQUENCE_ADVANTAGES], batch[keys.REWARDS])


def test_buffer_filter_chooses_the_groups_put_back(plugin):
    from runtime.rollout.plugins import BufferedPromptSource

    feed = SimpleNamespace(take=lambda n: [Sample(prompt=f"fresh{k}", metadata={"handout": k}) for k in range(n)])
    source = BufferedPromptSource(
        feed, SimpleNamespace(), n_samples=2, buffer_filter=hook("--buffer-filter-path", "pop_last")
    )
    groups = [[Sample(prompt=f"old{k}"), Sample(prompt=f"old{k}")] for k in range(3)]
    source.add_samples(groups)
    got = source.get_samples(2)
    assert [g[0].prompt for g in got] == ["old2", "old1"] and source.get_buffer_length() == 1
    assert plugin.CALLS["buffer_filter"] == [{"rollout_id": None, "buffered": 3, "num_samples": 2}]


@pytest.mark.parametrize("body", ["sys.exit(3)", "raise KeyboardInterrupt", "raise GeneratorExit"])
@pytest.mark.parametrize("kind", ["def", "async def"])
def test_a_hook_that_exits_is_a_one_line_hook_failure(tmp_path, body, kind):
    # Not SystemExit escaping a worker thread (the job waited for it forever) or ending the job with no word.
    path = tmp_path / "exits.py"
    path.write_text(f"import sys\n\n\n{kind} hook(args, sample):\n    {body}\n")
    hook = resolve_hook("--rollout-sample-hook-path", f"{path}:hook")
    with pytest.raises(HookFailure, match=rf"--rollout-sample-hook-path {path}:hook: raised \w+.*exits.py:5\)"):
        out = hook(None, None)
        asyncio.run(out)


def test_a_stop_signal_passes_through_a_hook(tmp_path):
    from runtime.errors import JobInterrupted

    path = tmp_path / "stopped.py"
    path.write_text(
        "import signal\nfrom runtime.errors import JobInterrupted\n\n\ndef hook(args, sample):\n"
        "    raise JobInterrupted(signal.SIGTERM)\n"
    )
    with pytest.raises(JobInterrupted, match="stopped by SIGTERM"):
        resolve_hook("--rollout-sample-hook-path", f"{path}:hook")(None, None)
