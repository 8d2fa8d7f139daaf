"""SFT mode: slime's multi-turn loss masks by chat template, the SFT loss against a float64 masked NLL, and SFT
lowering held-out NLL on the tiny model (in-process trainers on the CPU)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore import keys
from runtime.config import from_dict, validate
from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.rollout.data import PromptDataset
from runtime.rollout.sample import Sample
from runtime.rollout.sft import MultiTurnLossMaskGenerator, sft_sample
from runtime.train.algo import advantage_config, loss_config
from runtime.train.backends.torch_backend import TorchTrainer
from runtime.train.batch import build_batch
from runtime.train.hooks import train_hooks
from runtime.train.step import train_rollout

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}={{ m['content'] }}<eos>{% else %}{{ m['content'] }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("chat"), alphabet=task.ALPHABET, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tokenizer(chat_model):
    return AutoTokenizer.from_pretrained(chat_model)


def conversation(a: int, b: int) -> list[dict]:
    return [
        {"role": "user", "content": f"{a}c{b}"},
        {"role": "assistant", "content": str(a + b)},
        {"role": "user", "content": f"{b}c{a}"},
        {"role": "assistant", "content": str(a + b)},
    ]


def test_loss_masks_cover_the_assistant_turns_only(tokenizer):
    gen = MultiTurnLossMaskGenerator(tokenizer, "qwen")
    ids, mask = gen.get_loss_mask(conversation(3, 4))
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert "".join(pieces) == "3c4=7<eos>4c3=7<eos>"
    # The assistant header "=" is the generation prompt: not trained; the answer and its <eos> are.
    assert [p for p, m in zip(pieces, mask, strict=True) if m] == ["7", "<eos>", "7", "<eos>"]
    skipped = conversation(3, 4)
    skipped[1]["step_loss_mask"] = 0
    _, mask = gen.get_loss_mask(skipped)
    assert [p for p, m in zip(pieces, mask, strict=True) if m] == ["7", "<eos>"]
    s = sft_sample(Sample(index=0, prompt=conversation(3, 4)), gen)
    assert s.response_length == len(ids) - 4 and s.loss_mask == [1, 1, 0, 0, 0, 0, 1, 1]
    ids, mask = MultiTurnLossMaskGenerator(tokenizer, "distill_qwen").get_loss_mask(conversation(1, 2)[:2])
    assert "".join(tokenizer.convert_ids_to_tokens(ids)) == "1c2=3" and mask == [0, 0, 0, 0, 1]


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_flag(tokenizer):
    rewriting = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    # Only the last assistant turn is rendered in full (as templates that drop past reasoning do).
    rewriting.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}=0{% elif m['role'] == "
        "'assistant' %}={{ m['content'] }}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="--loss-mask-type qwen: the chat template renders message"):
        MultiTurnLossMaskGenerator(rewriting, "qwen").get_loss_mask(conversation(3, 4))


def test_sft_data_keeps_conversations_and_tools(tokenizer, tmp_path):
    cfg = validate(from_dict(None, output_dir=str(tmp_path), input_key="messages"))
    rows = [{"messages": conversation(1, 2), "tools": [{"name": "calc"}]}]
    ds = PromptDataset.from_records(rows, tokenizer, cfg.data, seed=0, messages=True)
    (s,) = ds.next_batch(1)
    assert s.prompt == conversation(1, 2) and s.tokens == [] and s.metadata["tools"] == [{"name": "calc"}]


def _cfg(tmp_path, **overrides):
    settings = {
        "rollout_batch_size": 8,
        "n_samples_per_prompt": 1,
        "global_batch_size": 8,
        "micro_batch_size": 4,
        "loss_type": "sft_loss",
        "calculate_per_token_loss": True,
        "disable_compute_advantages_and_returns": True,
        "lr": 1e-2,
        "use_kl_loss": False,
        **overrides,
    }
    return validate(from_dict(None, output_dir=str(tmp_path), **settings))


def _batch(tokenizer, pairs):
    gen = MultiTurnLossMaskGenerator(tokenizer, "qwen")
    samples = [
        sft_sample(Sample(index=i, group_index=i, prompt=conversation(a, b)), gen) for i, (a, b) in enumerate(pairs)
    ]
    return build_batch(samples, pad_token_id=tokenizer.pad_token_id)


def _trainer(chat_model, cfg):
    hooks = train_hooks(cfg)
    return hooks, TorchTrainer(
        chat_model, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, seed=0, hooks=hooks
    )


@torch.no_grad()
def _nll64(chat_model_or_model, batch, *, per_sample=False):
    """float64 masked NLL of the batch's trained tokens: one token mean over all of them (or per sample)."""
    model = chat_model_or_model.double()
    total = count = 0.0
    means = []
    for i in range(batch.batch_size[0]):
        n = int(batch["prompt_lengths"][i] + batch["response_lengths"][i])
        r = int(batch["response_lengths"][i])
        ids = batch["tokens"][i, :n][None]
        logp = model(input_ids=ids).logits[0].double().log_softmax(-1)
        targets = ids[0, n - r :]
        lp = logp[n - r - 1 : n - 1].gather(1, targets[:, None])[:, 0]
        m = batch[keys.MASK][i, :r].double()
        total += float(-(lp * m).sum())
        count += float(m.sum())
        means.append(float(-(lp * m).sum() / m.sum()))
    return means if per_sample else total / count


@pytest.mark.parametrize("per_token", [True, False])
def test_sft_loss_is_the_masked_nll_in_float64(chat_model, tokenizer, tmp_path, per_token):
    batch = _batch(tokenizer, [(a % 5, (3 * a) % 5) for a in range(8)])
    cfg = _cfg(tmp_path, calculate_per_token_loss=per_token)
    hooks, trainer = _trainer(chat_model, cfg)
    want = _nll64(AutoModelForCausalLM.from_pretrained(chat_model), batch, per_sample=not per_token)
    if not per_token:
        want = sum(want) / len(want)
    metrics = train_rollout(
        trainer, batch, global_batch_size=8, adv_cfg=advantage_config(cfg), hooks=hooks, resolved=hooks.resolve()
    )
    assert metrics["loss"] == pytest.approx(want, rel=1e-5)
    assert "advantage_abs_mean" not in metrics  # no advantages, no log-prob recompute


def test_sft_lowers_held_out_nll(chat_model, tokenizer, tmp_path):
    pairs = [(a, b) for a in range(5) for b in range(5)]
    # Held out: every fifth pair (its answer is one the training pairs have too).
    train_pairs = [p for i, p in enumerate(pairs) if i % 5]
    held_out = _batch(tokenizer, [p for i, p in enumerate(pairs) if i % 5 == 0])
    cfg = _cfg(tmp_path)
    hooks, trainer = _trainer(chat_model, cfg)
    before = _nll64(AutoModelForCausalLM.from_pretrained(chat_model), held_out)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        picks = torch.randint(0, len(train_pairs), (8,), generator=g).tolist()
        train_rollout(
            trainer,
            _batch(tokenizer, [train_pairs[i] for i in picks]),
            global_batch_size=8,
            adv_cfg=advantage_config(cfg),
            hooks=hooks,
            resolved=hooks.resolve(),
        )
    model = AutoModelForCausalLM.from_pretrained(chat_model)
    model.load_state_dict(trainer.model.state_dict())
    after = _nll64(model, held_out)
    assert after < 0.6 * before, (before, after)
