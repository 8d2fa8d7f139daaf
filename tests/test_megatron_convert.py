"""tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py on tiny Llama, Qwen2 and Qwen3 (CPU): HF ->
torch_dist -> HF gives the same tensors and the same logits from ``AutoModelForCausalLM.from_pretrained``; the
torch_dist folder loads into the Megatron backend with the log-probs of the HF weights; bad input exits 2 naming
the flag or the tensor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_megatron_backend import job, make_batch, save_model, trainer  # noqa: E402
from test_megatron_mapping import FAMILIES  # noqa: E402

from rlcore import keys  # noqa: E402
from runtime.train.backends import megatron_checkpoint as mck  # noqa: E402
from runtime.train.roles import ACTOR  # noqa: E402
from tools import convert_hf_to_megatron, convert_megatron_to_hf  # noqa: E402


def _logits(folder, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_hf_to_megatron_to_hf_gives_the_same_weights_and_logits(model_type, tmp_path):
    from safetensors.torch import load_file

    hf = save_model(model_type, tmp_path / "hf")
    root = tmp_path / "torch_dist"
    folder = convert_hf_to_megatron.convert(hf, str(root))
    assert folder == root / "release" and (root / mck.TRACKER).read_text() == "release"
    assert mck.is_checkpoint_folder(folder)
    # As slime's converter reads them: Megatron-LM's args in common.pt.
    assert mck.read_common(folder)["args"].num_layers == 4
    out = convert_megatron_to_hf.convert(str(root), str(tmp_path / "back"), origin_hf_dir=hf, chunk_size=20_000)
    assert len(list(out.glob("*.safetensors"))) > 1  # chunked
    original = load_file(str(Path(hf) / "model.safetensors"))
    back = {}
    for f in out.glob("*.safetensors"):
        back.update(load_file(str(f)))
    if FAMILIES[model_type]["tie_word_embeddings"]:
        original.pop("lm_head.weight", None)
    assert set(back) == set(original)
    for name, value in original.items():
        assert torch.equal(back[name], value), name
    tokens = torch.randint(0, 203, (3, 11), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(out, tokens), _logits(hf, tokens))


def test_rlcore_checkpoints_convert_without_the_origin_folder(tmp_path):
    hf = save_model("qwen3", tmp_path / "hf")
    root = tmp_path / "torch_dist"
    convert_hf_to_megatron.convert(hf, str(root))
    out = convert_megatron_to_hf.convert(str(root / "release"), str(tmp_path / "back"))
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    tokens = torch.randint(0, 203, (2, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(out, tokens), _logits(hf, tokens))
    from safetensors.torch import load_file

    half = convert_megatron_to_hf.convert(str(root), str(tmp_path / "bf16"), dtype="bfloat16")
    original = load_file(str(Path(hf) / "model.safetensors"))
    for f in half.glob("*.safetensors"):
        for name, value in load_file(str(f)).items():
            assert value.dtype == torch.bfloat16 and torch.equal(value, original[name].bfloat16()), name


def test_the_converted_checkpoint_loads_into_the_backend(tmp_path):
    hf = save_model("qwen2", tmp_path / "hf")
    root = tmp_path / "torch_dist"
    convert_hf_to_megatron.convert(hf, str(root))
    other = save_model("qwen2", tmp_path / "other", seed=1)  # same shape, other weights
    cfg = job(tmp_path)
    td = make_batch(203)
    from_hf = trainer("megatron", hf, cfg, roles=(ACTOR,))
    try:
        want = from_hf.compute_log_probs(td)[keys.OLD_LOG_PROBS]
    finally:
        from_hf.shutdown()
    loaded = trainer("megatron", other, cfg, roles=(ACTOR,))
    try:
        before = loaded.compute_log_probs(td)[keys.OLD_LOG_PROBS]
        loaded.load(str(root))
        got = loaded.compute_log_probs(td)[keys.OLD_LOG_PROBS]
    finally:
        loaded.shutdown()
    mask = td[keys.MASK]
    assert not torch.equal(before[mask], want[mask])
    assert torch.equal(got[mask], want[mask])


def test_a_shape_flag_that_disagrees_with_config_json_exits_2(tmp_path, capsys):
    hf = save_model("llama", tmp_path / "hf")
    argv = ["--hf-checkpoint", hf, "--save", str(tmp_path / "out"), "--hidden-size", "64", "--num-layers", "4"]
    # A model-shape flag is checked (rope agrees); Megatron's other flags, switches or not, are noted and ignored.
    argv += ["--use-rotary-position-embeddings", "--no-rope-fusion", "--moe-router-bias-update-rate", "0"]
    with pytest.raises(SystemExit) as exit_info:
        convert_hf_to_megatron.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "ignored (the model is built from config.json): --no-rope-fusion --moe-router-bias-update-rate" in err
    assert "--use-rotary-position-embeddings" not in err
    assert "--hidden-size 64 disagrees with" in err and "hidden_size gives 48" in err
    assert "--num-layers" not in err.split("ignored")[1]  # 4 agrees
    with pytest.raises(SystemExit) as exit_info:
        convert_hf_to_megatron.main(["--hf-checkpoint", hf, "--save", str(tmp_path / "o"), "--lr", "1e-5"])
    assert exit_info.value.code == 2 and "not used by the converter: --lr" in capsys.readouterr().err


def test_an_origin_config_of_another_model_is_refused_naming_the_tensor(tmp_path, capsys):
    hf = save_model("llama", tmp_path / "hf")
    wide = save_model("llama", tmp_path / "wide", intermediate_size=96)
    root = tmp_path / "torch_dist"
    convert_hf_to_megatron.convert(hf, str(root))
    argv = ["--input-dir", str(root), "--output-dir", str(tmp_path / "back"), "--origin-hf-dir", wide]
    with pytest.raises(SystemExit) as exit_info:
        convert_megatron_to_hf.main(argv)
    assert exit_info.value.code == 2
    assert "linear_fc1.weight has shape (160, 48), the model wants (192, 48)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert_megatron_to_hf.main(["--input-dir", str(tmp_path), "--output-dir", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert f"--input-dir {tmp_path}: no torch_dist checkpoint" in err


def test_the_actor_and_the_reference_start_from_megatron_checkpoints(tmp_path):
    """role_paths as the job gives them (--ref-load a torch_dist root; the actor from it too, slime's rule): both
    roles compute the log-probs of the converted weights, not of --hf-checkpoint's."""
    from runtime.train.roles import REFERENCE

    hf = save_model("qwen3", tmp_path / "hf")
    other = save_model("qwen3", tmp_path / "other", seed=1)
    root = tmp_path / "torch_dist"
    convert_hf_to_megatron.convert(other, str(root))
    cfg = job(tmp_path)
    td = make_batch(203)
    mask = td[keys.MASK]
    reference = trainer("megatron", other, cfg, roles=(ACTOR,))
    try:
        want = reference.compute_log_probs(td)[keys.OLD_LOG_PROBS]
    finally:
        reference.shutdown()
    paths = {REFERENCE.name: str(root), ACTOR.name: str(root)}
    both = trainer("megatron", hf, cfg, roles=(ACTOR, REFERENCE), role_paths=paths)
    try:
        got = both.compute_log_probs(td)
    finally:
        both.shutdown()
    assert torch.equal(got[keys.OLD_LOG_PROBS][mask], want[mask])
    assert torch.equal(got[keys.REF_LOG_PROBS][mask], want[mask])
