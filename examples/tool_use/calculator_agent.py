"""A multi-turn tool-calling rollout: the template for agents (slime's ``--custom-generate-function-path``).

The task: a prompt ``37u25=`` asks for 37 + 25 (``u`` stands for "plus" in the tiny model's alphabet). The model
may call a Python calculator by answering ``c`` in its first turn; the environment then appends the tool's output,
``62=``, and the model gives its final answer in a second turn. Without the call it gets only ``=`` and must add by
itself. Every token the environment wrote (the tool's output) has ``loss_mask`` 0: the policy is trained on its own
tokens only.

The reward (:func:`reward`, ``--custom-rm-path``) is 0.3 for calling the tool plus 0.7 times the built-in task's
partial credit of the final answer, so GRPO first learns to call the tool, then to copy its result.

Run it on the CPU with the tiny built-in model (a minute or two per 20 steps on two cores)::

    python -m examples.tool_use.calculator_agent data /tmp/calc.jsonl
    python -m runtime.cli --prompt-data /tmp/calc.jsonl --input-key prompt --label-key label \\
        --custom-generate-function-path examples.tool_use.calculator_agent:generate \\
        --custom-rm-path examples.tool_use.calculator_agent:reward \\
        --rollout-batch-size 16 --n-samples-per-prompt 8 --rollout-max-response-len 4 --num-rollout 60 \\
        --global-batch-size 128 --micro-batch-size 32 --lr 2e-3 --actor-num-gpus-per-node 1

To write your own agent, keep the shape of :func:`generate`: loop over turns, sample each turn with
:func:`runtime.rollout.engine_generate` (passing ``sample.session_id`` keeps a conversation on one SGLang server),
append model tokens with their log-probs and environment tokens with ``trainable=False``
(``Sample.append_response_tokens``), and stop on the model's answer or a turn budget. To train on each turn as a
sample of its own, return a list of samples instead (they share the prompt's group and one ``rollout_id``, and
the loss averages over the whole rollout's tokens once, as slime does).
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

from runtime.demo import task
from runtime.rollout import current_context, engine_generate
from runtime.rollout.sample import Sample

TOOL_CALL = "c"
TOOL_BONUS = 0.3


def calculator(expression: str) -> str:
    """The tool: ``"37u25"`` -> ``"62"``, or ``"?"`` for anything it cannot read."""
    left, _, right = expression.partition("u")
    if not (left.isdigit() and right.isdigit()):
        return "?"
    return str(int(left) + int(right))


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False) -> Sample:
    """Two turns: a one-token decision (call the calculator or not), the environment's reply (loss-masked), then
    the answer. ``sample.metadata`` records whether the tool was called and the final answer's text."""
    tokenizer = current_context().tokenizer
    decision = await engine_generate(
        sample.tokens, {**sampling_params, "max_new_tokens": 1}, session_id=sample.session_id
    )
    sample.response_length, sample.loss_mask, sample.rollout_log_probs = 0, [], []
    sample.append_response_tokens(args, tokens=decision.token_ids, log_probs=decision.log_probs)
    called = tokenizer.decode(decision.token_ids, skip_special_tokens=True) == TOOL_CALL
    expression = str(sample.prompt).rstrip("=")
    observation = f"{calculator(expression)}=" if called else "="
    sample.append_response_tokens(
        args, tokens=tokenizer(observation, add_special_tokens=False)["input_ids"], trainable=False
    )
    answer = await engine_generate(sample.tokens, sampling_params, session_id=sample.session_id)
    sample.append_response_tokens(
        args,
        tokens=answer.token_ids,
        log_probs=answer.log_probs,
        meta_info={"finish_reason": {"type": answer.finish_reason}},
    )
    final = tokenizer.decode(answer.token_ids, skip_special_tokens=True)
    sample.response = tokenizer.decode(decision.token_ids, skip_special_tokens=True) + observation + final
    sample.metadata = {**sample.metadata, "tool_called": called, "final_answer": final}
    return sample


def reward(args: Any, sample: Sample, **kwargs: Any) -> float:
    """0.3 for a tool call plus 0.7 x the partial credit of the final answer against the sum."""
    called = bool(sample.metadata.get("tool_called"))
    return TOOL_BONUS * called + (1 - TOOL_BONUS) * task.score(sample.metadata.get("final_answer", ""), sample.label)


def make_records(n: int, *, seed: int) -> list[dict[str, str]]:
    """``n`` rows ``{"prompt": "37u25=", "label": "62"}`` of two-digit sums."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        rows.append({"prompt": f"{a}u{b}=", "label": str(a + b)})
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "data":
        print("usage: python -m examples.tool_use.calculator_agent data OUT.jsonl", file=sys.stderr)
        return 2
    with open(argv[1], "w") as f:
        for row in make_records(512, seed=0):
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
