"""The embedded engine's sampling and log-probs, and the rollout plumbing around engines (no Ray actors started).

Engine log-probs are checked against the trainer's recompute (``TorchTrainer.compute_log_probs``) and a float64
forward pass; rollout and placement logic runs against in-process fakes of the engine group.
"""

import asyncio
import json
import math
import threading
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore import keys
from runtime.cluster.engines import EngineGroup, assign_chunks
from runtime.cluster.placement import plan_bundles
from runtime.config import RewardConfig, from_dict, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.engines import HFEngine, SamplingParams
from runtime.engines.base import Generation
from runtime.rollout import RolloutContext, apply_generation, collect_rollout, expand_groups, generate, generate_groups
from runtime.rollout.filters import DynamicFilterOutput
from runtime.rollout.generation import concat_nuclei
from runtime.rollout.rewards import RewardHub
from runtime.rollout.sample import Sample
from runtime.train.algo import loss_config
from runtime.train.backends.torch_backend import TorchTrainer
from runtime.train.batch import NUCLEUS_IDS, build_batch

SMALL = {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "global_batch_size": 16, "micro_batch_size": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), alphabet=task.ALPHABET, seed=0))


def _with_generation_config(tiny: str, folder, **fields) -> str:
    """A copy of the tiny model whose generation_config.json sets ``fields`` (as a real checkpoint may)."""
    model = AutoModelForCausalLM.from_pretrained(tiny)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(fields))
    return str(folder)


def _prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` prompts of different lengths (so the engine left-pads them)."""
    records = task.make_records(n, seed=3)
    return [tokenizer(r["prompt"][: 2 + i % 4])["input_ids"] for i, r in enumerate(records)]


@torch.no_grad()
def _reference_log_probs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """float64 ``log_softmax(logits / T)`` over the whole vocabulary of each response token, unpadded."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_generation_config_json_of_the_checkpoint_does_not_change_sampling(tiny, tmp_path):
    # min_p 0.999 keeps only the most likely token: if the engine let it through, every token would be the argmax.
    path = _with_generation_config(tiny, tmp_path / "m", min_p=0.999, top_h=0.01, repetition_penalty=5.0, min_length=6)
    engine = HFEngine(path, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = _prompts(tokenizer, 16)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=4))
    argmax_hits = total = 0
    for prompt, g in zip(prompts, gens, strict=True):
        logits = engine.model(input_ids=torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1 : -1]
        argmax_hits += int((logits.argmax(-1) == torch.tensor(g.token_ids)).sum())
        total += len(g.token_ids)
    # The random-init model's distribution is near uniform over ~20 tokens: the argmax is drawn about 1 in 10.
    assert total >= 32 and argmax_hits / total < 0.5
    assert engine.model.generation_config.min_p is None and engine.model.generation_config.top_h is None


@pytest.mark.parametrize("running", [None, 3])
def test_rollout_log_probs_are_untruncated_and_match_the_trainer_under_top_p(tiny, tmp_path, running):
    temperature = 0.8
    engine = HFEngine(tiny, seed=1, max_running_requests=running)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    prompts = _prompts(tokenizer, 16)
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=temperature, top_p=0.5))
    samples = []
    for i, (prompt, g) in enumerate(zip(prompts, gens, strict=True)):
        s = Sample(group_index=i // 4, index=i, tokens=prompt + g.token_ids, response_length=len(g.token_ids))
        s.rollout_log_probs, s.reward = g.log_probs, float(i % 4)
        samples.append(s)
        ref = _reference_log_probs(engine.model, prompt, g.token_ids, temperature)
        assert torch.allclose(torch.tensor(g.log_probs, dtype=torch.float64), ref, atol=1e-5)
    td = build_batch(samples, pad_token_id=tokenizer.pad_token_id)
    cfg = validate(from_dict(None, output_dir=str(tmp_path / "out"), **SMALL))
    trainer = TorchTrainer(tiny, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=temperature, seed=0)
    td.update(trainer.compute_log_probs(td))
    mask = td[keys.MASK]
    gap = (td[keys.OLD_LOG_PROBS] - td[keys.ROLLOUT_LOG_PROBS])[mask].abs().max()
    assert gap < 1e-5
    # top_p 0.5 of a near-uniform distribution truncates hard: the truncated log-probs would be far above these.
    assert td[keys.ROLLOUT_LOG_PROBS][mask].max() < -1.0


@pytest.mark.parametrize(
    ("running", "packed"), [(None, False), (3, True)], ids=["one-batch", "refill-and-packed-micro-batches"]
)
def test_top_p_replay_engine_log_probs_equal_the_trainers_over_the_reported_nucleus(tiny, tmp_path, running, packed):
    # slime's top-p replay: the engine reports each token's nucleus and its log-prob renormalised over it; the trainer
    # takes its log-probs over the same nucleus, so that the two agree where the untruncated ones would not. Also with
    # continuous refill (3 slots for 16 prompts: refilled slots report their new prompts' nuclei) and the trainer's
    # packed micro-batches.
    temperature, top_p = 0.8, 0.5
    engine = HFEngine(tiny, seed=1, max_running_requests=running)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    prompts = _prompts(tokenizer, 16)
    params = SamplingParams(max_new_tokens=6, temperature=temperature, top_p=top_p, return_top_p_token_ids=True)
    gens = engine.generate(prompts, params)
    samples = []
    for i, (prompt, g) in enumerate(zip(prompts, gens, strict=True)):
        s = apply_generation(Sample(group_index=i // 4, index=i, tokens=list(prompt)), g, tokenizer)
        s.reward = float(i % 4)
        samples.append(s)
        offsets, ids = s.rollout_top_p_token_offsets, s.rollout_top_p_token_ids
        assert len(offsets) == len(g.token_ids) + 1 and offsets[-1] == len(ids)
        with torch.no_grad():
            z = engine.model(input_ids=torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1 : -1].double()
        p = torch.softmax(z / temperature, -1)
        for t, token in enumerate(g.token_ids):
            nucleus = ids[offsets[t] : offsets[t + 1]]
            assert token in nucleus
            # SGLang's rule: the most likely tokens whose mass before each is at most top_p.
            order = p[t].argsort(descending=True)
            before = p[t][order].cumsum(0) - p[t][order]
            assert sorted(nucleus) == sorted(order[before <= top_p].tolist())
            # The reported log-prob is the drawn token's over the nucleus, in float64 by hand.
            ref = math.log(p[t, token] / p[t, nucleus].sum())
            assert g.log_probs[t] == pytest.approx(ref, abs=1e-5)
    td = build_batch(samples, pad_token_id=tokenizer.pad_token_id, top_p_replay=True)
    packing = {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 40} if packed else {}
    cfg = validate(from_dict(None, output_dir=str(tmp_path / "out"), **SMALL, **packing))
    trainer = TorchTrainer(tiny, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=temperature, seed=0)
    td.update(trainer.compute_log_probs(td))
    mask = td[keys.MASK]
    assert (td[keys.OLD_LOG_PROBS] - td[keys.ROLLOUT_LOG_PROBS])[mask].abs().max() < 1e-5
    # Without the nucleus the trainer's log-probs are the untruncated ones, far below: the replay is what matched.
    plain = trainer.compute_log_probs(td.exclude(NUCLEUS_IDS))[keys.OLD_LOG_PROBS]
    assert (td[keys.ROLLOUT_LOG_PROBS] - plain)[mask].min() > -1e-6
    assert (td[keys.ROLLOUT_LOG_PROBS] - plain)[mask].mean() > 0.3
    # Training reads the same log-probs (not the fused LM-head loss, which knows no nucleus): with the weights that
    # sampled, the policy's log-probs equal the rollout's.
    cfg = validate(
        from_dict(
            None, output_dir=str(tmp_path / "o2"), use_kl_loss=False, get_mismatch_metrics=True, **SMALL, **packing
        )
    )
    trainer = TorchTrainer(tiny, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=temperature, seed=0)
    td.set(keys.ADVANTAGES, torch.randn(mask.shape))
    metrics = trainer.train(td, per_step_rows=16)
    assert metrics["rollout_log_prob_abs_diff"] < 1e-5 and metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    # ... and the entropy stays the whole distribution's, as slime takes it: the same as without the replay.
    untruncated = TorchTrainer(tiny, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=temperature, seed=0)
    plain_metrics = untruncated.train(td.exclude(NUCLEUS_IDS), per_step_rows=16)
    assert metrics["entropy"] == pytest.approx(plain_metrics["entropy"], rel=1e-5)
    assert plain_metrics["ratio_mean"] < 0.8  # its untruncated log-probs against the replayed old ones


def test_top_p_replay_needs_the_nucleus_of_every_sample(tiny):
    s = Sample(group_index=0, index=7, tokens=[1, 2, 3], response_length=1, reward=1.0, rollout_log_probs=[-1.0])
    with pytest.raises(ValueError, match="sample 0 .index 7. has no rollout_top_p_token_ids"):
        build_batch([s], pad_token_id=0, top_p_replay=True)
    s.rollout_top_p_token_ids, s.rollout_top_p_token_offsets = [3, 4], [0, 2, 2]
    with pytest.raises(ValueError, match="has 3 entries, response_length \\+ 1 = 2 expected"):
        build_batch([s], pad_token_id=0, top_p_replay=True)
    s.rollout_top_p_token_offsets = [0, 2]
    assert build_batch([s], pad_token_id=0, top_p_replay=True)[NUCLEUS_IDS].tolist() == [[[3, 4]]]


def test_a_partial_rollouts_nuclei_are_its_parts_one_after_the_other():
    first = ([5, 6, 7], [0, 2, 3])  # two tokens: {5, 6}, {7}
    second = ([1, 2, 3, 4], [0, 1, 4])  # two tokens: {1}, {2, 3, 4}
    ids, offsets = concat_nuclei(first, second)
    assert ids == [5, 6, 7, 1, 2, 3, 4] and offsets == [0, 2, 3, 4, 7]
    assert concat_nuclei(([], [0]), second) == second


def test_top_k_1_samples_the_argmax_and_reports_its_full_log_prob(tiny):
    engine = HFEngine(tiny, seed=2)
    prompts = _prompts(AutoTokenizer.from_pretrained(tiny), 4)
    for prompt, g in zip(prompts, engine.generate(prompts, SamplingParams(max_new_tokens=3, top_k=1)), strict=True):
        logits = engine.model(input_ids=torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1 : -1]
        assert g.token_ids == logits.argmax(-1).tolist()
        ref = _reference_log_probs(engine.model, prompt, g.token_ids, 1.0)
        assert torch.allclose(torch.tensor(g.log_probs, dtype=torch.float64), ref, atol=1e-5)
        assert max(g.log_probs) < -0.5  # not log(1) = 0, the truncated top-1 distribution's


def test_engine_stops_on_every_eos_of_generation_config(tiny, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    extra_eos = tokenizer.convert_tokens_to_ids("5")
    path = _with_generation_config(tiny, tmp_path / "m", eos_token_id=[tokenizer.eos_token_id, extra_eos])
    engine = HFEngine(path, seed=0)
    assert engine.eos_token_ids == sorted({tokenizer.eos_token_id, extra_eos})
    prompts = _prompts(tokenizer, 32)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    for g in gens:
        assert extra_eos not in g.token_ids[:-1]
        assert (g.finish_reason == "stop") == (g.token_ids[-1] in engine.eos_token_ids)
    assert sum(g.token_ids[-1] == extra_eos for g in gens) >= 3
    # stop_token_ids add to the eos ids, as in SGLang.
    more = tokenizer.convert_tokens_to_ids("7")
    for g in engine.generate(prompts, SamplingParams(max_new_tokens=12, stop_token_ids=(more,))):
        assert not {extra_eos, more} & set(g.token_ids[:-1])


def test_eos_union_of_tokenizer_and_generation_config():
    from runtime.engines.hf_engine import eos_token_ids

    assert eos_token_ids(2, [7, 2, 9]) == [2, 7, 9]
    assert eos_token_ids(2, 5) == [2, 5]
    assert eos_token_ids(None, None) == []


# --- rollout and engine group, against fakes -------------------------------------------------------------------


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "ok"


class _Engines:
    """An engine group whose generations abort for the prompts in ``abort`` (first sample of each group)."""

    def __init__(self, abort=()):
        self.abort, self.seen = set(abort), set()

    def rewind(self):
        pass

    async def generate(self, prompts, params, *, session_ids=None):
        assert session_ids is None or len(session_ids) == len(prompts)
        out = []
        for p in prompts:
            first = p[0] not in self.seen
            self.seen.add(p[0])
            reason = "abort" if p[0] in self.abort and first else "length"
            out.append(Generation(token_ids=[1, 2], log_probs=[-0.5, -0.5], finish_reason=reason))
        return out


def _next_prompts():
    counter = iter(range(1000))

    def take(n):
        # Even prompts earn reward 1 (the fake tokenizer decodes every response to "ok"), odd ones 0.
        return [Sample(index=k, tokens=[k + 10], label="ok" if k % 2 == 0 else "no") for k in take_ids(n)]

    def take_ids(n):
        return [next(counter) for _ in range(n)]

    return take


def _collect(engines, *, args=None, custom_generate=None, **kw):
    ctx = RolloutContext(engines=engines, tokenizer=_Tokenizer(), args=args or SimpleNamespace())
    hub = RewardHub(RewardConfig(rm_type="exact_match"))
    try:
        return asyncio.run(
            collect_rollout(
                ctx, _next_prompts(), hub, n_samples=2, params=SamplingParams(4), **kw, custom_generate=custom_generate
            )
        )
    finally:
        hub.close()


def test_rollout_skip_special_tokens_reaches_the_response_text():
    from runtime.rollout import RolloutContext

    class Tok:
        def decode(self, ids, skip_special_tokens):
            return "4" if skip_special_tokens else "4</s>"

    assert apply_generation(Sample(tokens=[3]), Generation([4, 2], [-0.1, -0.2], "stop"), Tok()).response == "4"
    kept = apply_generation(Sample(), Generation([4, 2], [-0.1, -0.2], "stop"), Tok(), skip_special_tokens=False)
    assert kept.response == "4</s>"  # slime's default keeps them
    assert not RolloutContext(None, None, from_dict(None, hf_checkpoint="m")).skip_special_tokens
    assert RolloutContext(None, None, from_dict(None)).skip_special_tokens  # the built-in job's value
    assert RolloutContext(
        None, None, from_dict(None, hf_checkpoint="m", rollout_skip_special_tokens=True)
    ).skip_special_tokens


@pytest.mark.parametrize(("reason", "status"), [("stop", "COMPLETED"), ("length", "TRUNCATED"), ("abort", "ABORTED")])
def test_apply_generation_maps_finish_reason_to_status(reason, status):
    s = apply_generation(Sample(tokens=[3]), Generation([4], [-0.1], reason), _Tokenizer())
    assert s.status == Sample.Status[status]


def test_groups_with_an_aborted_sample_are_dropped_counted_and_replaced():
    samples, metrics, _ = _collect(_Engines(abort={11}), rollout_batch_size=2, over_sampling_batch_size=3)
    assert [s.tokens[0] for s in samples] == [10, 10, 12, 12]
    assert all(s.status == Sample.Status.TRUNCATED and s.reward == 1.0 for s in samples)
    assert metrics["rollout/groups_aborted"] == 1 and metrics["rollout/samples_aborted"] == 1
    assert metrics["rollout/groups_generated"] == 3 and metrics["reward/num_scored"] == 4


def test_over_sampled_groups_are_counted_and_the_pre_filter_reward_is_logged():
    samples, metrics, _ = _collect(_Engines(), rollout_batch_size=2, over_sampling_batch_size=3)
    assert [s.tokens[0] for s in samples] == [10, 10, 11, 11]
    assert metrics["rollout/groups_discarded"] == 1 and metrics["rollout/groups_dropped"] == 0
    assert metrics["rollout/reward_mean"] == pytest.approx(0.5)
    assert metrics["rollout/reward_mean_before_filter"] == pytest.approx(2 / 3)

    def drop_zero(args, group, **kwargs):
        return DynamicFilterOutput(keep=group[0].reward > 0, reason="zero")

    samples, metrics, _ = _collect(_Engines(), rollout_batch_size=2, over_sampling_batch_size=2, filter_fn=drop_zero)
    assert [s.tokens[0] for s in samples] == [10, 10, 12, 12]
    assert metrics["rollout/groups_dropped"] == 2 and metrics["rollout/groups_discarded"] == 0
    assert metrics["rollout/reward_mean"] == 1.0 and metrics["rollout/reward_mean_before_filter"] == 0.5


def test_custom_generate_may_return_an_aborted_empty_sample():
    async def custom(args, sample, sampling_params):
        if sample.tokens[0] == 10:
            sample.status = Sample.Status.ABORTED
            return sample
        sample.tokens, sample.response_length = [*sample.tokens, 5], 1
        sample.rollout_log_probs, sample.status = [-0.3], Sample.Status.COMPLETED
        return sample

    samples, metrics, _ = _collect(
        _Engines(), custom_generate=custom, rollout_batch_size=1, over_sampling_batch_size=2
    )
    assert [s.tokens for s in samples] == [[11, 5], [11, 5]]
    assert metrics["rollout/groups_aborted"] == 1 and metrics["rollout/samples_aborted"] == 2


def test_generate_groups_runs_the_hook_in_the_rollout_context_and_splits_aborted_groups():
    async def custom(args, sample, sampling_params):
        return await generate(args, sample, sampling_params)  # needs the rollout context

    ctx = RolloutContext(engines=_Engines(abort={11}), tokenizer=_Tokenizer(), args=SimpleNamespace())
    groups = expand_groups(_next_prompts()(3), 2, first_group=0)
    whole, aborted = asyncio.run(generate_groups(ctx, groups, SamplingParams(4), custom))
    assert [g[0].tokens[0] for g in whole] == [10, 12] and [g[0].tokens[0] for g in aborted] == [11]
    assert [s.status for s in aborted[0]] == [Sample.Status.ABORTED, Sample.Status.TRUNCATED]


def test_use_tis_needs_rollout_log_probs_from_custom_generate():
    async def custom(args, sample, sampling_params):
        sample.tokens, sample.response_length = [*sample.tokens, 5], 1
        return sample

    tis = SimpleNamespace(algo=SimpleNamespace(use_tis=True))
    with pytest.raises(ValueError, match="rollout_log_probs None, which --use-tis needs"):
        _collect(_Engines(), args=tis, custom_generate=custom, rollout_batch_size=1)
    samples, _, _ = _collect(_Engines(), custom_generate=custom, rollout_batch_size=1)
    with pytest.raises(ValueError, match=r"sample 0 \(index 0\) has no rollout_log_probs"):
        build_batch(samples, pad_token_id=0, require_rollout_log_probs=True)
    td = build_batch(samples, pad_token_id=0)
    assert td[keys.ROLLOUT_LOG_PROBS].abs().sum() == 0


class _Actor:
    def __init__(self, index):
        self.index = index
        self.generate = SimpleNamespace(remote=self._generate)

    async def _generate(self, prompts, params):
        return [
            Generation(token_ids=list(p), log_probs=[0.0] * len(p), finish_reason="length", weight_version=self.index)
            for p in prompts
        ]


def _engine_group(n):
    group = EngineGroup.__new__(EngineGroup)
    group.actors, group._next_engine, group.router = [_Actor(i) for i in range(n)], 0, None
    group._lock, group._restarts, group.counts = threading.Lock(), {}, Counter()
    return group


def test_single_prompt_calls_go_round_robin_over_engines():
    group = _engine_group(3)

    async def many():
        return await asyncio.gather(*(group.generate([[i]], SamplingParams(1)) for i in range(7)))

    outs = asyncio.run(many())
    assert [o[0].weight_version for o in outs] == [0, 1, 2, 0, 1, 2, 0]
    assert [o[0].token_ids for o in outs] == [[i] for i in range(7)]
    batch = asyncio.run(group.generate([[i] for i in range(5)], SamplingParams(1)))
    assert [g.token_ids for g in batch] == [[i] for i in range(5)]  # prompt order kept
    assert [g.weight_version for g in batch] == [0, 0, 1, 1, 2]  # a full batch starts on engine 0
    one = asyncio.run(group.generate([[9]], SamplingParams(1)))  # and does not move the round-robin position
    assert one[0].weight_version == 1
    group.rewind()
    assert asyncio.run(group.generate([[9], [8]], SamplingParams(1)))[0].weight_version == 0


@given(n_prompts=st.integers(1, 40), n_engines=st.integers(1, 9), start=st.integers(0, 20))
def test_assign_chunks_covers_prompts_in_order_on_distinct_engines(n_prompts, n_engines, start):
    chunks = assign_chunks(n_prompts, n_engines, start=start)
    assert [lo for _, lo, _ in chunks] == [0] + [hi for _, _, hi in chunks[:-1]] and chunks[-1][2] == n_prompts
    size = -(-n_prompts // n_engines)
    assert [hi - lo for _, lo, hi in chunks[:-1]] == [size] * (len(chunks) - 1) and len(chunks) <= n_engines
    assert len({e for e, _, _ in chunks}) == len(chunks) and chunks[0][0] == start % n_engines


def test_sglang_mode_reserves_no_engine_bundles(tmp_path):
    common = {"output_dir": str(tmp_path), "actor_num_gpus_per_node": 2, "rollout_num_gpus": 2}
    hf = plan_bundles(from_dict(None, **common))
    assert (hf.n_bundles, hf.engine_bundles, hf.share) == (4, [2, 3], 1.0)
    colo = plan_bundles(from_dict(None, **common, colocate=True))
    assert (colo.n_bundles, colo.engine_bundles, colo.share) == (2, [0, 1], 0.5)
    for colocate in (False, True):
        sg = plan_bundles(
            from_dict(None, **common, colocate=colocate, rollout_engine="sglang", sglang_url="http://h:1")
        )
        assert (sg.n_bundles, sg.trainer_bundles, sg.engine_bundles, sg.share) == (2, [0, 1], [], 1.0)
