"""slime's reward types (--rm-type), --reward-key / --eval-reward-key, --group-rm and remote_rm against a local HTTP
server (one that answers, one that fails a few times, one that always fails)."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runtime.config import ConfigError, RewardConfig, parse_args
from runtime.rollout.rewards import RewardHub
from runtime.rollout.rm_hub import last_boxed
from runtime.rollout.sample import Sample


def score(rm_type, response, label, metadata=None, **cfg):
    hub = RewardHub(RewardConfig(rm_type=rm_type, **cfg), seed=0)
    sample = Sample(index=0, group_index=0, prompt="q", response=response, label=label, metadata=metadata or {})
    rewards = asyncio.run(hub.score([sample]))
    assert hub.pop_metrics()["reward/errors"] == 0
    return rewards[0], sample.reward


@pytest.mark.parametrize(
    ("response", "label", "want"),
    [
        ("<think>so 2</think> The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("<think>x</think> \\boxed{3}", "\\boxed{3}", 1.0),
        ("<think>x</think> \\boxed{4}", "3", 0.0),
        ("no think tag \\boxed{3}", "3", 0.0),  # deepscaler scores only the solution after </think>
        ("<think>x</think> no box", "3", 0.0),
        ("###Response \\boxed{10}", "10", 1.0),
    ],
)
def test_deepscaler(response, label, want):
    assert score("deepscaler", response, label)[0] == want


@pytest.mark.parametrize(
    ("response", "label", "want"),
    [
        ("reasoning...\nAnswer: 42", "42", 1.0),
        ("Answer: 41\nwait\nAnswer: $42$", "42.0", 1.0),  # the last Answer line, an integer label
        ("Answer: \\boxed{1,000}", "1000", 1.0),
        ("Answer: 7", "42", -1.0),
        ("the answer is 42", "42", -1.0),  # no "Answer:" line
    ],
)
def test_dapo_scores_plus_or_minus_one_with_its_prediction(response, label, want):
    value, stored = score("dapo", response, label)
    assert value == want and stored["score"] == want and stored["acc"] == (want == 1.0)


def test_f1():
    assert score("f1", "The Eiffel Tower!", "eiffel tower")[0] == 1.0
    # prediction "paris france" vs "paris": precision 1/2, recall 1 -> 2/3
    assert score("f1", "Paris, France", "Paris")[0] == pytest.approx(2 / 3)
    assert score("f1", "yes", "no")[0] == 0.0
    assert score("f1", "no idea", "something else")[0] == 0.0


@pytest.mark.parametrize(
    ("response", "label", "metadata", "want"),
    [
        ("<think>A? no</think> The answer is C", "C", {}, 1.0),
        ("The answer is (B)", "C", {}, 0.0),
        ("Final: D", 3, {}, 1.0),  # an index label
        ("I pick B", "blue whale", {"choices": ["cat", "blue whale", "dog"]}, 1.0),  # the label is a choice's text
        ("It is the blue whale", "x", {"choices": ["cat", "blue whale"], "correct_letter": "B"}, 1.0),
    ],
)
def test_gpqa(response, label, metadata, want):
    assert score("gpqa", response, label, metadata)[0] == want


def test_boxed_prefix_scores_the_boxed_answer_only():
    assert last_boxed("a \\boxed{x^{2}} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("no box") is None
    assert score("boxed_f1", "blah blah \\boxed{Eiffel Tower}", "eiffel tower")[0] == 1.0
    assert score("f1", "blah blah \\boxed{Eiffel Tower}", "eiffel tower")[0] < 1.0
    assert score("boxed_f1", "no box at all", "eiffel tower")[0] == 0.0


def test_random_is_zero_or_one_and_seeded():
    hub_a, hub_b = (RewardHub(RewardConfig(rm_type="random"), seed=3) for _ in range(2))
    samples = [Sample(index=i, group_index=i) for i in range(32)]
    a, b = asyncio.run(hub_a.score(samples)), asyncio.run(hub_b.score(samples))
    assert a == b and set(a) == {0.0, 1.0}


def test_reward_key_and_eval_reward_key_pick_the_scalar_of_a_dict_reward():
    cfg = RewardConfig(rm_type="dapo", reward_key="acc", eval_reward_key="score")
    sample = Sample(index=0, group_index=0, response="Answer: 5", label="7")
    assert asyncio.run(RewardHub(cfg).score([sample])) == [0.0]  # acc False
    assert asyncio.run(RewardHub(cfg, evaluation=True).score([sample])) == [-1.0]
    missing = RewardHub(RewardConfig(rm_type="dapo", reward_key="nope"))
    assert asyncio.run(missing.score([sample])) == [0.0] and missing.pop_metrics()["reward/errors"] == 1


def test_group_rm_calls_a_batched_function_once_per_group(tmp_path):
    hook, log = tmp_path / "group_rm.py", tmp_path / "calls.jsonl"
    # The calls run in worker processes: each notes the groups it saw in a file.
    hook.write_text(
        "import json\n"
        "async def reward(args, samples, **kwargs):\n"
        f"    with open({str(log)!r}, 'a') as fh:\n"
        "        fh.write(json.dumps(sorted(s.group_index for s in samples)) + '\\n')\n"
        "    return [float(len(samples))] * len(samples)\n"
    )

    def calls():
        seen = [json.loads(line) for line in log.read_text().splitlines()]
        log.unlink()
        return seen

    samples = [Sample(index=i, group_index=i // 3) for i in range(9)]
    hub = RewardHub(RewardConfig(custom_rm_path=f"{hook}:reward", group_rm=True))
    assert asyncio.run(hub.score(samples)) == [3.0] * 9
    assert sorted(calls()) == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    per_round = RewardHub(RewardConfig(custom_rm_path=f"{hook}:reward"))
    assert asyncio.run(per_round.score(samples)) == [9.0] * 9 and len(calls()) == 1
    hub.close()
    per_round.close()


# ---------------------------------------------------------------- remote_rm


class _RewardServer:
    """A local reward server: ``fail_first`` requests get HTTP 500, the rest ``{"score": response == label}``."""

    def __init__(self, fail_first=0):
        self.payloads, self.fail_first = [], fail_first
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.payloads.append(body)
                if len(server.payloads) <= server.fail_first:
                    self.send_response(500)
                    self.end_headers()
                    return
                out = json.dumps({"score": float(body["response"] == body["label"])}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/reward"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _remote_hub(url):
    return RewardHub(RewardConfig(rm_type="remote_rm", rm_url=url, reward_timeout=5.0), remote_backoff_s=0.001)


def test_remote_rm_posts_prompt_response_label_and_reads_the_score():
    with _RewardServer() as server:
        hub = _remote_hub(server.url)
        samples = [Sample(index=0, group_index=0, prompt="p", response="4", label="4"), Sample(index=1, response="5")]
        samples[1].label = "4"
        assert asyncio.run(hub.score(samples)) == [1.0, 0.0]
    assert sorted(p["response"] for p in server.payloads) == ["4", "5"]
    assert server.payloads[0].keys() == {"prompt", "response", "label"}
    metrics = hub.pop_metrics()
    assert (metrics["reward/errors"], metrics["reward/remote_failures"]) == (0, 0)


def test_remote_rm_retries_a_failing_server_and_counts_the_failures():
    with _RewardServer(fail_first=3) as server:
        hub = _remote_hub(server.url)
        assert asyncio.run(hub.score([Sample(index=0, response="a", label="a")])) == [1.0]
    metrics = hub.pop_metrics()
    assert (metrics["reward/errors"], metrics["reward/remote_failures"]) == (0, 3)
    assert len(server.payloads) == 4


def test_remote_rm_that_always_fails_scores_zero_and_counts_an_error():
    with _RewardServer(fail_first=10**6) as server:
        hub = _remote_hub(server.url)
        assert asyncio.run(hub.score([Sample(index=0, response="a", label="a")])) == [0.0]
    metrics = hub.pop_metrics()
    assert (metrics["reward/errors"], metrics["reward/remote_failures"]) == (1, 10)  # slime's 10 tries
    assert len(server.payloads) == 10


def test_remote_rm_goes_through_http_proxy():
    # The local server answers any path, so it can stand in for a proxy: the reward host itself does not resolve.
    with _RewardServer() as proxy:
        cfg = RewardConfig(
            rm_type="remote_rm", rm_url="http://reward.invalid/score", http_proxy=proxy.url, reward_timeout=5.0
        )
        hub = RewardHub(cfg, remote_backoff_s=0.001)
        assert asyncio.run(hub.score([Sample(index=0, response="a", label="a")])) == [1.0]
    assert proxy.payloads == [{"prompt": "", "response": "a", "label": "a"}]


def test_remote_rm_unreachable_server_scores_zero():
    hub = _remote_hub("http://127.0.0.1:9/reward")  # the discard port: nothing listens
    assert asyncio.run(hub.score([Sample(index=0, response="a", label="a")])) == [0.0]
    assert hub.pop_metrics()["reward/errors"] == 1


def test_rm_type_flags_are_validated():
    with pytest.raises(ConfigError, match="--rm-type remote_rm needs --rm-url"):
        parse_args(["--rm-type", "remote_rm"])
    with pytest.raises(ConfigError, match="--rm-type ifbench: slime's reward type is not built yet"):
        parse_args(["--rm-type", "ifbench"])
    with pytest.raises(ConfigError, match="--rm-type must be one of"):
        parse_args(["--rm-type", "magic"])
    assert parse_args(["--rm-type", "boxed_dapo"]).reward.rm_type == "boxed_dapo"
