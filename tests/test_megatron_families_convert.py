"""tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py on the families issue 27's third stage added
to the Megatron backend (CPU): GLM-4 dense (post-norms), GLM-4.5 (shared expert, expert bias, the first layer dense)
and the DeepSeek-V3 layout (MLA): HF -> torch_dist -> HF gives the checkpoint's tensors back, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from test_megatron_deepseek_v3 import deepseek_model  # noqa: E402
from test_megatron_glm4 import glm4_model  # noqa: E402
from test_megatron_glm4_moe import glm4_moe_model  # noqa: E402

from tools import convert_hf_to_megatron, convert_megatron_to_hf  # noqa: E402

MODELS = {"glm4": glm4_model, "glm4_moe": glm4_moe_model, "deepseek_v3": deepseek_model}


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_to_torch_dist_to_hf_gives_the_same_tensors(name, tmp_path):
    from safetensors.torch import load_file

    hf = tmp_path / "hf"
    MODELS[name]().save_pretrained(hf)
    root = tmp_path / "torch_dist"
    convert_hf_to_megatron.convert(str(hf), str(root))
    out = convert_megatron_to_hf.convert(str(root), str(tmp_path / "back"), origin_hf_dir=str(hf))
    original = load_file(str(Path(hf) / "model.safetensors"))
    back = {}
    for f in out.glob("*.safetensors"):
        back.update(load_file(str(f)))
    assert set(back) == set(original)
    for key, value in original.items():
        assert torch.equal(back[key], value), key
