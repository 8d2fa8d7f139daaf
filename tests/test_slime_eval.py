"""Evaluation datasets: --eval-prompt-data pairs and --eval-config YAML, resolved as slime resolves them (the
dataset's setting, else the config's defaults, else the --eval-* flags, else the rollout's)."""

import pytest

from runtime.config import ConfigError, eval_datasets, parse_args
from runtime.evaluation import eval_data_config, eval_hub


def _files(tmp_path, *names):
    paths = []
    for name in names:
        path = tmp_path / f"{name}.jsonl"
        path.write_text('{"prompt": "1+1", "label": "2"}\n')
        paths.append(str(path))
    return paths


def test_prompt_data_pairs_and_a_bare_path(tmp_path):
    a, b = _files(tmp_path, "a", "b")
    cfg = parse_args(["--eval-prompt-data", "aime", a, "gsm8k", b, "--eval-top-k", "1"])
    assert [(d.name, d.path, d.top_k) for d in eval_datasets(cfg)] == [("aime", a, 1), ("gsm8k", b, 1)]
    (only,) = eval_datasets(parse_args(["--eval-prompt-data", b]))
    assert (only.name, only.path) == ("aime", b)  # slime names a lone path aime
    with pytest.raises(ConfigError, match="name/path pairs"):
        parse_args(["--eval-prompt-data", "aime", a, "gsm8k"])
    with pytest.raises(ConfigError, match="names must differ"):
        parse_args(["--eval-prompt-data", "x", a, "x", b])


def test_eval_config_resolution_order(tmp_path):
    a, b = _files(tmp_path, "a", "b")
    config = tmp_path / "eval.yaml"
    config.write_text(
        f"""
eval:
  defaults:
    max_response_len: 16
    top_p: 0.7
    metadata_overrides: {{source: bench}}
  datasets:
    - name: aime
      path: {a}
      rm_type: deepscaler
      n_samples_per_eval_prompt: 4
      top_p: 0.9
      input_key: question
    - name: gpqa
      path: {b}
      rm_type: boxed_gpqa
      metadata_overrides: {{split: diamond}}
"""
    )
    argv = ["--eval-config", str(config), "--eval-temperature", "0.6", "--rollout-top-k", "5"]
    argv += ["--n-samples-per-eval-prompt", "2", "--input-key", "prompt", "--label-key", "label"]
    cfg = parse_args(argv)
    aime, gpqa = eval_datasets(cfg)
    assert (aime.top_p, aime.max_response_len, aime.n_samples_per_eval_prompt) == (0.9, 16, 4)  # own, defaults
    assert (gpqa.top_p, gpqa.n_samples_per_eval_prompt) == (0.7, 2)  # defaults, --n-samples-per-eval-prompt
    assert (aime.temperature, aime.top_k) == (0.6, 5)  # --eval-temperature, then the rollout's top-k
    assert (aime.input_key, gpqa.input_key, gpqa.label_key) == ("question", "prompt", "label")
    assert gpqa.metadata_overrides == {"source": "bench", "split": "diamond"}
    assert eval_data_config(cfg, aime).input_key == "question"
    assert eval_hub(cfg, aime).name == "deepscaler" and eval_hub(cfg, gpqa).name == "boxed_gpqa"
    # The same file as a mapping by name, without the eval level.
    mapping = tmp_path / "mapping.yaml"
    mapping.write_text(f"datasets:\n  aime: {{path: {a}}}\n  gpqa: {{path: {b}}}\n")
    assert [d.name for d in eval_datasets(parse_args(["--eval-config", str(mapping)]))] == ["aime", "gpqa"]


def test_eval_config_problems_are_named(tmp_path):
    (a,) = _files(tmp_path, "a")
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"eval:\n  datasets:\n    - {{name: aime, path: {a}, min_eval_samples: 3, stop: ['x']}}\n")
    with pytest.raises(ConfigError, match="dataset 'aime' sets min_eval_samples, which rlcore-run does not"):
        parse_args(["--eval-config", str(bad)])
    bad.write_text(f"eval:\n  datasets:\n    - {{name: aime, path: {a}, rm_type: magic, top_p: 2}}\n")
    with pytest.raises(ConfigError) as info:
        parse_args(["--eval-config", str(bad)])
    assert {"evaluation dataset 'aime': rm_type 'magic' is out of range",
            "evaluation dataset 'aime': top_p 2 is out of range"} <= set(info.value.problems)  # fmt: skip
    bad.write_text(f"eval:\n  datasets:\n    - {{name: aime, path: {tmp_path / 'missing.jsonl'}}}\n")
    with pytest.raises(ConfigError, match="--eval-config: file .*missing.jsonl"):
        parse_args(["--eval-config", str(bad)])
    bad.write_text("eval:\n  defaults: {top_p: 0.5}\n")
    with pytest.raises(ConfigError, match="defines no datasets"):
        parse_args(["--eval-config", str(bad)])
    with pytest.raises(ConfigError, match="--eval-config: file"):
        parse_args(["--eval-config", str(tmp_path / "nope.yaml")])
