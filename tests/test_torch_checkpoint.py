"""The torch backend's checkpoint I/O (runtime/train/backends/torch_checkpoint.py) on plain modules, one process:
what is saved, what is restored, and what is refused. Restored tensors are copies of the saved ones, so equality is
exact."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from runtime.train.backends.torch_checkpoint import load_state, save_state, trained_entries


def _stepped(seed: int, *, frozen: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model after one AdamW step on a seeded input (so the optimizer holds moments); ``frozen``: its first
    layer does not train."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    if frozen:
        model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [state["exp_avg"].clone() for state in optimizer.state.values()]


def _saved_keys(path) -> set[str]:
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def test_save_then_load_restores_weights_and_optimizer_of_actor_and_critic(tmp_path):
    model, optimizer = _stepped(0)
    critic, critic_optimizer = _stepped(1)
    save_state(str(tmp_path), model=model, optimizer=optimizer, critic=critic, critic_optimizer=critic_optimizer)
    other, other_optimizer = _stepped(2)
    other_critic, other_critic_optimizer = _stepped(3)
    load_state(
        str(tmp_path),
        model=other,
        optimizer=other_optimizer,
        critic=other_critic,
        critic_optimizer=other_critic_optimizer,
    )
    for want, got in [(model, other), (critic, other_critic)]:
        for a, b in zip(want.state_dict().values(), got.state_dict().values(), strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    for want, got in [(optimizer, other_optimizer), (critic_optimizer, other_critic_optimizer)]:
        for a, b in zip(_moments(want), _moments(got), strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_without_optimizer_the_weights_load_and_the_optimizer_keeps_its_state(tmp_path):
    model, optimizer = _stepped(0)
    save_state(str(tmp_path), model=model, optimizer=optimizer, with_optimizer=False)
    assert not any(key.startswith("optim") for key in _saved_keys(tmp_path))
    other, other_optimizer = _stepped(2)
    kept = _moments(other_optimizer)
    load_state(str(tmp_path), model=other, optimizer=other_optimizer)
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    for a, b in zip(kept, _moments(other_optimizer), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_lora_only_saves_the_trained_parameters_and_leaves_the_frozen_ones(tmp_path):
    model, optimizer = _stepped(0, frozen=True)
    assert set(trained_entries(model, model.state_dict(), lora_only=True)) == {"1.weight", "1.bias"}
    assert set(trained_entries(model, model.state_dict(), lora_only=False)) == set(model.state_dict())
    save_state(str(tmp_path), model=model, optimizer=optimizer, lora_only=True)
    assert {key for key in _saved_keys(tmp_path) if key.startswith("model.")} == {"model.1.weight", "model.1.bias"}
    other, other_optimizer = _stepped(2, frozen=True)
    frozen_before = other[0].weight.clone()
    load_state(str(tmp_path), model=other, optimizer=other_optimizer, lora_only=True)
    torch.testing.assert_close(other[1].weight, model[1].weight, rtol=0, atol=0)
    torch.testing.assert_close(other[0].weight, frozen_before, rtol=0, atol=0)


def test_loading_a_critic_from_a_checkpoint_without_one_names_the_cause(tmp_path):
    model, optimizer = _stepped(0)
    save_state(str(tmp_path), model=model, optimizer=optimizer)
    critic, critic_optimizer = _stepped(1)
    with pytest.raises(RuntimeError, match="holds no critic"):
        load_state(str(tmp_path), model=model, optimizer=optimizer, critic=critic, critic_optimizer=critic_optimizer)
