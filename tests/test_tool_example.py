"""The multi-turn tool-calling example (examples/tool_use/calculator_agent.py): its tool tokens are loss-masked, it
runs as a whole job on the CPU with the tiny model, and (slow) it learns."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from examples.tool_use import calculator_agent as agent
from runtime.config import parse_args
from runtime.demo import task
from runtime.demo.tiny_model import build_tokenizer
from runtime.engines.base import Generation
from runtime.logger import METRICS_FILE, read_metrics
from runtime.loop import run
from runtime.rollout import RolloutContext
from runtime.rollout.generation import _running
from runtime.rollout.sample import Sample


class _Engines:
    """Turn 1 answers ``first``; turn 2 answers "62" and stops."""

    def __init__(self, tokenizer, first):
        self.tokenizer, self.first = tokenizer, first

    def rewind(self):
        pass

    async def generate(self, prompts, params, *, session_ids=None):
        text = self.first if params.max_new_tokens == 1 else "62"
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [Generation(ids, [-0.5] * len(ids), "stop") for _ in prompts]


@pytest.mark.parametrize(("first", "observation"), [("c", "62="), ("3", "=")])
def test_tool_output_is_loss_masked_and_the_reward_counts_the_call(first, observation):
    tokenizer = build_tokenizer(task.ALPHABET)
    ctx = RolloutContext(engines=_Engines(tokenizer, first), tokenizer=tokenizer, args=SimpleNamespace())
    prompt = tokenizer("37u25=")["input_ids"]
    sample = Sample(prompt="37u25=", tokens=list(prompt), label="62", session_id="0-0")

    async def go():
        with _running(ctx):
            return await agent.generate(ctx.args, sample, {"max_new_tokens": 4, "temperature": 1.0})

    out = asyncio.run(go())
    tool = len(observation)
    assert out.tokens[: len(prompt)] == prompt and out.response == first + observation + "62"
    assert out.loss_mask == [1] + [0] * tool + [1, 1]
    assert out.rollout_log_probs == [-0.5] + [0.0] * tool + [-0.5, -0.5]
    assert out.response_length == 1 + tool + 2 and out.status == Sample.Status.COMPLETED
    assert agent.reward(None, out) == pytest.approx((0.3 if first == "c" else 0.0) + 0.7)


def _job(tmp_path, steps, *extra):
    data = tmp_path / "calc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in agent.make_records(256, seed=0)))
    argv = ["--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label"]
    argv += ["--custom-generate-function-path", "examples.tool_use.calculator_agent:generate"]
    argv += ["--custom-rm-path", "examples.tool_use.calculator_agent:reward", "--rollout-max-response-len", "4"]
    argv += ["--num-rollout", str(steps), "--actor-num-gpus-per-node", "1", "--output-dir", str(tmp_path / "out")]
    return read_metrics(run(parse_args([*argv, *extra]), progress=False).output_dir / METRICS_FILE)


def test_the_example_runs_as_a_job(ray_session, tmp_path):
    rows = _job(tmp_path, 1, "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16")
    (row,) = rows
    assert 0.0 <= row["rollout/reward_mean"] <= 1.0 and "train/loss" in row


@pytest.mark.slow
def test_the_example_learns_to_call_the_tool(tmp_path):
    rows = _job(
        tmp_path,
        60,
        *("--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "128"),
        *("--micro-batch-size", "32", "--lr", "2e-3"),
    )
    rewards = [r["rollout/reward_mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"calculator agent: first-10 mean reward {first:.3f}, last-10 {last:.3f}")
    assert last >= first + 0.2
