"""runtime.rollout.data: JSONL/Parquet prompt sets filtering, bad rows, shuffling, resume."""

import json

import jinja2
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from runtime.config import DataConfig
from runtime.rollout.data import DataError, PromptDataset
from runtime.rollout.sample import Sample

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = "what is plus minus times the answer a b c one two three four five six seven eight nine".split()

# The rows below are keyed prompt/label (slime's flag defaults are input and no label).
KEYS = {"input_key": "prompt", "label_key": "label"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A real ``PreTrainedTokenizerFast`` (word-level, BOS added by its post-processor), saved and reloaded."""
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|system|>", "<|assistant|>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS + [str(d) for d in range(10)] + list("+-*?=."))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|system|>", "<|assistant|>"]})
    fast.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(path)
    loaded = AutoTokenizer.from_pretrained(path)
    assert loaded.chat_template == CHAT_TEMPLATE
    return loaded


def _write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _rows(n):
    return [{"prompt": f"what is {i % 10} plus {(3 * i) % 10}", "label": str(i % 10 + (3 * i) % 10)} for i in range(n)]


def test_jsonl_plain_prompts_with_keys_by_flag(tmp_path, tokenizer):
    rows = [{"question": r["prompt"], "answer": r["label"], "info": {"id": i}} for i, r in enumerate(_rows(5))]
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = DataConfig(input_key="question", label_key="answer", metadata_key="info", rollout_shuffle=False)
    ds = PromptDataset(path, tokenizer, cfg, seed=0)
    assert len(ds) == 5
    batch = ds.next_batch(5)
    assert all(isinstance(s, Sample) for s in batch)
    for i, sample in enumerate(batch):
        assert sample.index == i
        assert sample.prompt == rows[i]["question"]
        assert sample.label == rows[i]["answer"]
        assert sample.metadata == {"id": i}
        assert sample.response_length == 0 and sample.status == Sample.Status.PENDING
        # Plain text is tokenized as the tokenizer does by default: with its BOS.
        assert sample.tokens == tokenizer(rows[i]["question"])["input_ids"]
        assert sample.tokens[0] == tokenizer.bos_token_id


def test_jsonl_with_byte_order_mark(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "a", "label": "b"}).encode() + b"\n")
    assert PromptDataset(path, None, DataConfig(**KEYS), seed=0).next_batch(1)[0].label == "b"


def test_chat_template_through_the_tokenizer(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "answer the question"}, {"role": "user", "content": "what is 2 + 3"}]
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "what is 1 + 1", "label": "2"}, {"prompt": messages}])
    with pytest.raises(DataError, match="line 2: missing key 'label'"):
        PromptDataset(path, tokenizer, DataConfig(**KEYS, apply_chat_template=True), seed=0)
    path = _write_jsonl(
        tmp_path / "chat.jsonl", [{"prompt": "what is 1 + 1", "label": "2"}, {"prompt": messages, "label": "5"}]
    )
    ds = PromptDataset(path, tokenizer, DataConfig(**KEYS, apply_chat_template=True, rollout_shuffle=False), seed=0)
    first, second = ds.next_batch(2)
    template = jinja2.Template(CHAT_TEMPLATE)
    assert first.prompt == template.render(
        messages=[{"role": "user", "content": "what is 1 + 1"}], add_generation_prompt=True
    )
    assert second.prompt == template.render(messages=messages, add_generation_prompt=True)
    assert second.prompt.endswith("<|assistant|>")
    # The template already placed the special tokens: no BOS is added on top.
    assert second.tokens == tokenizer(second.prompt, add_special_tokens=False)["input_ids"]
    assert second.tokens[0] == tokenizer.convert_tokens_to_ids("<|system|>")


def test_chat_messages_without_template_flag_are_bad_rows(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "label": "x"}])
    with pytest.raises(DataError, match="line 1: .*pass --apply-chat-template"):
        PromptDataset(path, tokenizer, DataConfig(**KEYS), seed=0)


def test_tokenizer_without_chat_template_is_refused(tmp_path, tokenizer):
    plain = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = None
    path = _write_jsonl(tmp_path / "p.jsonl", _rows(2))
    with pytest.raises(DataError, match="no chat_template"):
        PromptDataset(path, plain, DataConfig(**KEYS, apply_chat_template=True), seed=0)


def test_long_prompts_dropped_and_counted(tmp_path, tokenizer):
    words = ["one", "two", "three", "four", "five", "six", "seven"]
    rows = [{"prompt": " ".join(words[: k + 1]), "label": str(k)} for k in range(7)]
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    limit = 4
    ds = PromptDataset(
        path, tokenizer, DataConfig(**KEYS, rollout_max_prompt_len=limit, rollout_shuffle=False), seed=0
    )
    # Each prompt is k+1 words plus BOS.
    expected_kept = [r for k, r in enumerate(rows) if k + 2 <= limit]
    assert len(ds) == len(expected_kept) == 3
    assert ds.num_dropped_long == len(rows) - len(expected_kept)
    assert ds.stats() == {"data/num_prompts": 3, "data/num_dropped_long": 4, "data/num_bad_rows": 0}
    assert [s.prompt for s in ds.next_batch(3)] == [r["prompt"] for r in expected_kept]
    assert all(len(s.tokens) <= limit for s in ds.next_batch(3))
    with pytest.raises(DataError, match="no usable prompts .* 7 longer than --rollout-max-prompt-len 1"):
        PromptDataset(path, tokenizer, DataConfig(**KEYS, rollout_max_prompt_len=1), seed=0)


BAD_LINES = [
    {"prompt": "what is 1 plus 2", "label": "3"},
    {"prompt": "what is 2 plus 2", "label": "4"},
    '{"prompt": "what is 3 plus 2", "label": ',  # line 3: truncated JSON
    "",  # line 4: blank, not a row
    {"label": "5"},  # line 5: no prompt
    {"prompt": 17, "label": "5"},  # line 6: prompt of the wrong type
    {"prompt": "what is 4 plus 4", "label": "8", "metadata": [1, 2]},  # line 7: metadata not a dict
    '["a", "list"]',  # line 8: not an object
    {"prompt": "what is 5 plus 1", "label": "6", "metadata": '{"source": "x"}'},
]


def test_malformed_rows_fail_with_line_number(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    with pytest.raises(DataError) as info:
        PromptDataset(path, tokenizer, DataConfig(**KEYS), seed=0)
    message = str(info.value)
    assert f"{path} line 3: invalid JSON" in message and "--on-bad-row skip" in message


def test_malformed_rows_skipped_and_counted(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    ds = PromptDataset(path, tokenizer, DataConfig(**KEYS, on_bad_row="skip", rollout_shuffle=False), seed=0)
    assert [line for line, _ in ds.bad_rows] == [3, 5, 6, 7, 8]
    reasons = dict(ds.bad_rows)
    assert "invalid JSON" in reasons[3]
    assert "missing key 'prompt'" in reasons[5]
    assert "must be a string or a non-empty list" in reasons[6] and "int" in reasons[6]
    assert "'metadata' must be a dict" in reasons[7]
    assert "must be an object" in reasons[8]
    assert ds.num_bad_rows == 5 and len(ds) == 3
    samples = ds.next_batch(3)
    assert [s.label for s in samples] == ["3", "4", "6"]
    assert samples[2].metadata == {"source": "x"}


def test_parquet_loading_and_bad_row_numbers(tmp_path, tokenizer):
    table = pa.table(
        {
            "prompt": ["what is 1 plus 1", None, "what is 2 times 3"],
            "label": ["2", "0", "6"],
            "metadata": [{"k": 1}, {"k": 2}, {"k": 3}],
        }
    )
    path = tmp_path / "p.parquet"
    pq.write_table(table, path)
    with pytest.raises(DataError, match=r"p\.parquet row 2: .*NoneType"):
        PromptDataset(path, tokenizer, DataConfig(**KEYS), seed=0)
    ds = PromptDataset(path, tokenizer, DataConfig(**KEYS, on_bad_row="skip", rollout_shuffle=False), seed=0)
    assert ds.num_bad_rows == 1 and ds.bad_rows[0][0] == 2
    samples = ds.next_batch(2)
    assert [(s.prompt, s.label, s.metadata) for s in samples] == [
        ("what is 1 plus 1", "2", {"k": 1}),
        ("what is 2 times 3", "6", {"k": 3}),
    ]

    chat = pa.table({"prompt": [[{"role": "user", "content": "what is 4 plus 4"}]], "label": ["8"]})
    pq.write_table(chat, tmp_path / "chat.parquet")
    ds = PromptDataset(tmp_path / "chat.parquet", tokenizer, DataConfig(**KEYS, apply_chat_template=True), seed=0)
    assert ds.next_batch(1)[0].prompt == "<|user|> what is 4 plus 4 <|assistant|>"

    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="cannot read as Parquet"):
        PromptDataset(tmp_path / "junk.parquet", tokenizer, DataConfig(**KEYS), seed=0)


def _stream(ds, n_batches, batch_size):
    return [s.index for _ in range(n_batches) for s in ds.next_batch(batch_size)]


def test_per_epoch_shuffle_is_seeded_and_complete():
    records = _rows(12)
    make = lambda seed, shuffle=True: PromptDataset.from_records(  # noqa: E731
        records, None, DataConfig(**KEYS, rollout_shuffle=shuffle), seed=seed
    )
    first = _stream(make(3), 9, 4)  # three epochs of 12
    assert first == _stream(make(3), 9, 4)
    epochs = [first[i : i + 12] for i in range(0, 36, 12)]
    for order in epochs:
        assert sorted(order) == list(range(12))
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]
    assert first != _stream(make(4), 9, 4)
    assert _stream(make(3, shuffle=False), 6, 4) == list(range(12)) * 2
    ds = make(3)
    ds.next_batch(13)
    assert ds.epoch == 1 and ds.offset == 1


def test_state_dict_resumes_at_the_same_position(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "p.jsonl", _rows(10))
    cfg = DataConfig(**KEYS, rollout_max_prompt_len=64)
    ds = PromptDataset(path, tokenizer, cfg, seed=9)
    _stream(ds, 7, 3)  # 21 prompts: into the third epoch
    state = json.loads(json.dumps(ds.state_dict()))  # checkpoints store it as plain data
    expected = [(s.index, s.prompt, s.tokens) for s in ds.next_batch(15)]

    resumed = PromptDataset(path, tokenizer, cfg, seed=9)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.offset) == (2, 1)
    assert [(s.index, s.prompt, s.tokens) for s in resumed.next_batch(15)] == expected

    with pytest.raises(DataError, match="cannot resume"):
        PromptDataset(path, tokenizer, cfg, seed=10).load_state_dict(state)
    with pytest.raises(DataError, match="missing"):
        resumed.load_state_dict({"epoch": 0})


def test_samples_are_independent_copies():
    ds = PromptDataset.from_records(
        [{"prompt": "a", "label": ["x"], "metadata": {"tags": ["t"]}}], None, DataConfig(**KEYS), seed=0
    )
    sample = ds.next_batch(1)[0]
    sample.metadata["tags"].append("changed")
    sample.label.append("y")
    again = ds.next_batch(1)[0]
    assert again.metadata == {"tags": ["t"]} and again.label == ["x"]


def test_from_records_errors_name_the_record():
    with pytest.raises(DataError, match="<records> record 2: missing key 'label'"):
        PromptDataset.from_records([{"prompt": "a", "label": 1}, {"prompt": "b"}], None, DataConfig(**KEYS), seed=0)
    with pytest.raises(ValueError, match="tokenizer is None"):
        PromptDataset.from_records(_rows(2), None, DataConfig(**KEYS, rollout_max_prompt_len=3), seed=0)
    with pytest.raises(DataError, match="does not exist"):
        PromptDataset("/nonexistent/p.jsonl", None, DataConfig(**KEYS), seed=0)
    ds = PromptDataset.from_records(_rows(2), None, DataConfig(**KEYS), seed=0)
    with pytest.raises(ValueError, match="n must be a positive int"):
        ds.next_batch(0)


@given(
    n_prompts=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
    sizes=st.lists(st.integers(1, 7), min_size=1, max_size=8),
    split=st.integers(0, 8),
    shuffle=st.booleans(),
)
def test_stream_is_epochwise_permutations_and_resume_anywhere_matches(n_prompts, seed, sizes, split, shuffle):
    records = [{"prompt": f"p{i}", "label": i} for i in range(n_prompts)]
    cfg = DataConfig(**KEYS, rollout_shuffle=shuffle)
    ds = PromptDataset.from_records(records, None, cfg, seed=seed)
    split = min(split, len(sizes))
    head = [s for size in sizes[:split] for s in ds.next_batch(size)]
    state = ds.state_dict()
    tail = [s.index for size in sizes[split:] for s in ds.next_batch(size)]
    assert all((s.prompt, s.label) == (records[s.index]["prompt"], records[s.index]["label"]) for s in head)
    stream = [s.index for s in head] + tail
    for start in range(0, len(stream) - n_prompts + 1, n_prompts):
        assert sorted(stream[start : start + n_prompts]) == list(range(n_prompts))
    if not shuffle:
        assert stream == [i % n_prompts for i in range(len(stream))]
    resumed = PromptDataset.from_records(records, None, cfg, seed=seed)
    resumed.load_state_dict(state)
    assert [s.index for size in sizes[split:] for s in resumed.next_batch(size)] == tail


def test_report_lists_counts_and_the_first_skipped_rows(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    ds = PromptDataset(path, tokenizer, DataConfig(**KEYS, on_bad_row="skip"), seed=0)
    lines = ds.report(max_rows=2)
    assert lines[0].startswith(f"{path}: {len(ds)} prompts; {ds.num_dropped_long} dropped as longer than")
    assert "5 malformed rows skipped" in lines[0]
    assert lines[1].startswith("  skipped line 3: invalid JSON") and lines[2].startswith("  skipped line 5: missing")
    assert lines[3] == "  ... and 3 more skipped rows" and len(lines) == 4
    assert ds.stats() == {"data/num_prompts": 3, "data/num_dropped_long": 0, "data/num_bad_rows": 5}
    # BOS + the 5 words of each kept prompt ("what is 1 plus 2" and alike).
    assert ds.max_prompt_tokens == max(len(tokenizer(s.prompt)["input_ids"]) for s in ds.next_batch(len(ds))) == 6


def _model_dir(tmp_path, tokenizer):
    folder = tmp_path / "model"
    tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


def test_job_prints_skipped_rows_and_checks_the_token_budget_against_the_data(tmp_path, tokenizer, capsys):
    from runtime.config import ConfigError, parse_args
    from runtime.job_data import prepare_model_and_data

    rows = [{"prompt": "what is 1 plus 2 plus 3 plus 4", "label": "10"}, {"prompt": "one", "label": "1"}, "{bad"]
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    argv = ["--hf-checkpoint", str(_model_dir(tmp_path, tokenizer)), "--prompt-data", str(path)]
    argv += ["--rm-type", "exact_match", "--on-bad-row", "skip", "--rollout-max-response-len", "4"]
    argv += ["--output-dir", str(tmp_path / "out"), "--input-key", "prompt", "--label-key", "label"]
    argv += ["--rollout-batch-size", "4", "--n-samples-per-prompt", "8", "--num-rollout", "1"]
    argv += ["--actor-num-gpus-per-node", "1", "--micro-batch-size", "8"]
    # Without --rollout-max-prompt-len validation cannot know the longest prompt: BOS + 9 words = 10 tokens.
    cfg = parse_args([*argv, "--max-tokens-per-gpu", "13", "--global-batch-size", "32"])
    with pytest.raises(ConfigError, match=r"--max-tokens-per-gpu 13 cannot hold the longest sample: a prompt of 10"):
        prepare_model_and_data(cfg)
    _, _, dataset, _ = prepare_model_and_data(parse_args([*argv, "--max-tokens-per-gpu", "14"]))
    out = capsys.readouterr().out
    assert f"{path}: 2 prompts; 0 dropped" in out and "1 malformed rows skipped" in out
    assert "  skipped line 3: invalid JSON" in out
    assert dataset.max_prompt_tokens == 10
