"""slime's sampling flags: ``--rollout-stop`` strings (the embedded engine, and the SGLang adapter against the fake
SGLang server) and ``--eval-min-new-tokens``, from the command line to the engines' sampling parameters."""

from collections import Counter

import pytest
from fake_sglang import FakeSGLangServer
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoTokenizer

from runtime.config import ConfigError, eval_datasets, parse_args
from runtime.demo import task
from runtime.demo.tiny_model import make_tiny_model
from runtime.engines import HFEngine, SamplingParams
from runtime.engines.base import stop_string_end
from runtime.engines.sglang_engine import SGLangEngine, sampling_params_to_sglang
from runtime.evaluation import EvalSet
from runtime.job import sampling_params


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), alphabet=task.ALPHABET, seed=0))


def _prompts(tokenizer, n):
    return [tokenizer(r["prompt"][: 2 + i % 4])["input_ids"] for i, r in enumerate(task.make_records(n, seed=3))]


# ---------------------------------------------------------------- where a response with stop strings ends


@given(
    pieces=st.lists(st.sampled_from(["a", "b", "ab", "", "ba", "c"]), max_size=12),
    stops=st.lists(st.sampled_from(["ab", "b", "cc", "aba"]), min_size=1, max_size=2).map(tuple),
)
def test_stop_string_end_is_the_first_prefix_whose_text_holds_a_stop(pieces, stops):
    def decode(ids):
        return "".join(pieces[i] for i in ids)

    ids = list(range(len(pieces)))
    brute = next((n for n in range(1, len(ids) + 1) if any(s in decode(ids[:n]) for s in stops)), None)
    assert stop_string_end(ids, stops, decode) == brute
    assert stop_string_end(ids, (), decode) is None


def _check_ends_at_first_stop(generations, stop, decode, max_new_tokens):
    stopped = 0
    for g in generations:
        text = decode(g.token_ids)
        if stop in text:
            # The response ends with the token that completed the stop string, kept.
            assert stop not in decode(g.token_ids[:-1]) and g.finish_reason == "stop"
            stopped += 1
        else:
            assert g.finish_reason in ("stop", "length") and len(g.token_ids) <= max_new_tokens
        assert len(g.log_probs) == len(g.token_ids)
    return stopped


@pytest.mark.parametrize("width", [1, 2])
def test_embedded_engine_ends_responses_at_a_stop_string(tiny, width):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    engine = HFEngine(tiny, seed=0)
    prompts = _prompts(tokenizer, 32)
    free = [engine._decode(g.token_ids) for g in engine.generate(prompts, SamplingParams(max_new_tokens=16))]
    # The stop: the string of ``width`` characters most responses run through (one or two tokens of the tiny model).
    counts = Counter(text[i : i + width] for text in free for i in range(1, len(text) - width))
    stop = max(sorted(counts), key=lambda x: sum(x in text[1:] for text in free))
    assert sum(stop in text[1:] for text in free) >= 2  # unconstrained, responses run past it
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=16, stop=(stop,)))
    assert _check_ends_at_first_stop(gens, stop, engine._decode, 16) >= 2


def test_refill_honours_stop_strings_and_stop_ids_and_gives_each_prompt_the_same_response(tiny):
    """--engine-max-running-requests 3 over 24 prompts: the same responses as all at once, ending where they must."""
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    prompts = _prompts(tokenizer, 24)
    five = tokenizer.convert_tokens_to_ids("5")
    params = SamplingParams(max_new_tokens=16, stop=("7",), stop_token_ids=(five,))
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="max_running_requests"):
            HFEngine(tiny, seed=4, max_running_requests=bad)
    whole = HFEngine(tiny, seed=4).generate(prompts, params)
    engine = HFEngine(tiny, seed=4, max_running_requests=3)
    refilled = engine.generate(prompts, params)
    assert [g.token_ids for g in refilled] == [g.token_ids for g in whole]
    assert [g.finish_reason for g in refilled] == [g.finish_reason for g in whole]
    for a, b in zip(refilled, whole, strict=True):
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-6)
    assert _check_ends_at_first_stop(refilled, "7", engine._decode, 16) >= 2
    ids = [g for g in refilled if g.token_ids[-1] == five]
    assert ids and all(five not in g.token_ids[:-1] and g.finish_reason == "stop" for g in ids)
    assert len({len(g.token_ids) for g in refilled}) > 3  # mixed lengths: slots were refilled
    # The next call draws from new streams (the call count is part of each prompt's seed), and a restored count
    # draws the same again.
    state = engine.get_rng_state()
    again = engine.generate(prompts, params)
    assert [g.token_ids for g in again] != [g.token_ids for g in refilled]
    engine.set_rng_state(state)
    assert [g.token_ids for g in engine.generate(prompts, params)] == [g.token_ids for g in again]


def test_sglang_adapter_passes_stop_strings_and_the_fake_ends_there(tiny):
    params = SamplingParams(max_new_tokens=16, stop=("7",), min_new_tokens=3)
    sent = sampling_params_to_sglang(params)
    assert sent["stop"] == ["7"] and sent["min_new_tokens"] == 3
    assert "stop" not in sampling_params_to_sglang(SamplingParams(max_new_tokens=4))
    assert SamplingParams.from_dict(params.to_dict()) == params
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    with FakeSGLangServer(tiny, seed=0) as server:
        engine = SGLangEngine(server.url, timeout=30, max_retries=1, retry_backoff=0.01, startup_timeout=10)
        gens = engine.generate(_prompts(tokenizer, 16), SamplingParams(max_new_tokens=16, stop=("7",)))
        engine.close()

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=False)

    assert _check_ends_at_first_stop(gens, "7", decode, 16) >= 2


def test_min_new_tokens_holds_off_the_eos_and_stop_ids(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    engine = HFEngine(tiny, seed=0)
    prompts = _prompts(tokenizer, 32)
    five = tokenizer.convert_tokens_to_ids("5")
    short = engine.generate(prompts, SamplingParams(max_new_tokens=12, stop_token_ids=(five,)))
    assert any(len(g.token_ids) < 6 and g.finish_reason == "stop" for g in short)
    held = engine.generate(prompts, SamplingParams(max_new_tokens=12, stop_token_ids=(five,), min_new_tokens=6))
    assert all(len(g.token_ids) >= 6 for g in held)
    assert any(g.finish_reason == "stop" for g in held)


# ---------------------------------------------------------------- flags


def test_rollout_stop_and_eval_min_new_tokens_reach_the_sampling_params(tmp_path):
    data = tmp_path / "eval.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n')
    cfg = parse_args(
        ["--rollout-stop", "</answer>", "\n\n", "--eval-min-new-tokens", "4", "--eval-prompt-data", "a", str(data)]
        + ["--eval-interval", "1", "--output-dir", str(tmp_path / "out")]
    )
    assert sampling_params(cfg).stop == ("</answer>", "\n\n")
    (d,) = eval_datasets(cfg)
    params = EvalSet(d, [], None).params
    assert params.stop == ("</answer>", "\n\n") and params.min_new_tokens == 4  # slime: eval falls back to both
    # --eval-config: a dataset's own stop (one string or a list) and min_new_tokens win.
    yaml = tmp_path / "eval.yaml"
    yaml.write_text(f"eval:\n  datasets:\n    - {{name: a, path: {data}, stop: '###', min_new_tokens: 2}}\n")
    cfg = parse_args(["--eval-config", str(yaml), "--eval-interval", "1", "--output-dir", str(tmp_path / "out")])
    (d,) = eval_datasets(cfg)
    assert (EvalSet(d, [], None).params.stop, d.min_new_tokens) == (("###",), 2)
    with pytest.raises(ConfigError, match="--eval-min-new-tokens must be >= 0"):
        parse_args(["--eval-min-new-tokens", "-1"])
    with pytest.raises(ConfigError, match="--rollout-stop: stop strings must not be empty"):
        parse_args(["--rollout-stop", ""])
