"""DESIGN.md's promise, tried as a plug-in author would: a new rollout engine and a new training backend, each with a
flag of its own and a rule, are their own modules plus one registry line each, and the configuration takes them
with nothing in ``runtime/config/`` edited: the flags parse into their sections, a rule of the plug-in runs when it
is chosen, and the flags are refused under another choice, naming the owner.

The plug-ins are registered in a fresh interpreter before ``runtime.config`` is imported (the flag choices are
``Literal``s of the registries' names, read once at import), as a project's own registration module would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TOY_ENGINE_OPTIONS = """
from dataclasses import dataclass, field
from runtime.option_fields import bounded, own_fields

@dataclass(frozen=True)
class ToyEngineOptions:
    OWN = "a flag of the toy engine"
    toy_engine_width: int = field(default=1, metadata=bounded(gt=0, help="toy engine: requests per batch"))

OPTIONS = {"rollout": ToyEngineOptions}
OWN_FIELDS = own_fields(ToyEngineOptions)

def check(problems, cfg):
    if cfg.rollout.toy_engine_width > 4:
        problems.append(f"--toy-engine-width {cfg.rollout.toy_engine_width}: the toy engine batches at most 4")
"""

TOY_BACKEND_OPTIONS = """
from dataclasses import dataclass, field
from runtime.option_fields import described, own_fields

@dataclass(frozen=True)
class ToyBackendOptions:
    OWN = "a flag of the toy backend"
    toy_backend_depth: int = field(default=0, metadata=described("toy backend: layers trained"))

OPTIONS = {"train": ToyBackendOptions}
OWN_FIELDS = own_fields(ToyBackendOptions)
"""

# The one registry line of each plug-in, then the job's command lines.
DRIVER = """
import dataclasses, json, sys
import runtime.engines.registry as engines
import runtime.train.backends as backends

engines.ROLLOUT_ENGINES["toy"] = dataclasses.replace(
    engines.ROLLOUT_ENGINES["hf"], cls="toy_engine:ToyEngine", options="toy_engine_options"
)
backends.TRAIN_BACKENDS["toy"] = backends.Backend("toy_backend:ToyTrainer", "toy_backend_options")

from runtime.config import ConfigError, build_parser, parse_args

def outcome(argv):
    try:
        cfg = parse_args(argv)
    except ConfigError as err:
        return {"problems": err.problems}
    return {"width": cfg.rollout.toy_engine_width, "depth": cfg.train.toy_backend_depth,
            "engine": cfg.rollout.rollout_engine, "backend": cfg.train.train_backend}

toy = ["--rollout-engine", "toy", "--train-backend", "toy"]
print(json.dumps({
    "chosen": outcome([*toy, "--toy-engine-width", "3", "--toy-backend-depth", "2"]),
    "rule": outcome([*toy, "--toy-engine-width", "5"]),
    "bound": outcome([*toy, "--toy-engine-width", "0"]),
    "elsewhere": outcome(["--toy-engine-width", "3", "--toy-backend-depth", "2"]),
    "help": build_parser().format_help(),
}))
"""


def test_a_new_engine_and_backend_need_no_edit_of_the_config(tmp_path):
    (tmp_path / "toy_engine_options.py").write_text(textwrap.dedent(TOY_ENGINE_OPTIONS))
    (tmp_path / "toy_backend_options.py").write_text(textwrap.dedent(TOY_BACKEND_OPTIONS))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["chosen"] == {"width": 3, "depth": 2, "engine": "toy", "backend": "toy"}
    assert out["rule"] == {"problems": ["--toy-engine-width 5: the toy engine batches at most 4"]}
    assert out["bound"] == {"problems": ["--toy-engine-width must be > 0, got 0"]}
    assert sorted(out["elsewhere"]["problems"]) == [
        "--toy-backend-depth: a flag of the toy backend, used by --train-backend toy only",
        "--toy-engine-width: a flag of the toy engine, used by --rollout-engine toy only",
    ]
    assert "--toy-engine-width" in out["help"] and "--toy-backend-depth" in out["help"]


# What a plug-in can do is its own declaration too: the same toy plug-ins with and without their capabilities.
# Top-p replay: the engine reports each token's nucleus, the backend replays it (options module constants). A
# backend that reads Megatron torch_dist checkpoints takes one as --ref-load. An engine that holds a fixed fraction of
# its GPU (EngineKind.fixed_memory, its registry line) needs the offloads under --colocate.
CAPABILITY_DRIVER = """
import dataclasses, json, os, sys
import runtime.engines.registry as engines
import runtime.train.backends as backends

declared = os.environ["TOY_DECLARED"] == "1"
engines.ROLLOUT_ENGINES["toy"] = dataclasses.replace(
    engines.ROLLOUT_ENGINES["hf"], cls="toy_engine:ToyEngine", options="toy_engine_options", fixed_memory=declared
)
backends.TRAIN_BACKENDS["toy"] = backends.Backend("toy_backend:ToyTrainer", "toy_backend_options")

from runtime.config import ConfigError, parse_args

def problems(*argv):
    try:
        parse_args(list(argv))
    except ConfigError as err:
        return err.problems
    return []

print(json.dumps({
    "top_p": {
        f"{e}/{b}": problems("--rollout-engine", e, "--train-backend", b, "--rollout-top-p", "0.9")
        for e in ("hf", "toy") for b in ("torch", "toy")
    },
    "ref_load": problems("--train-backend", "toy", "--ref-load", sys.argv[1]),
    "colocate": problems("--rollout-engine", "toy", "--colocate", "--no-offload-train"),
}))
"""


def _capabilities(tmp_path, declared: bool) -> dict:
    folder = tmp_path / f"declared_{declared}"
    folder.mkdir()
    engine, backend = textwrap.dedent(TOY_ENGINE_OPTIONS), textwrap.dedent(TOY_BACKEND_OPTIONS)
    if declared:
        engine += "REPORTS_TOP_P_NUCLEI = True\n"
        backend += "REPLAYS_TOP_P_NUCLEI = True\nREADS_TORCH_DIST = True\n"
    (folder / "toy_engine_options.py").write_text(engine)
    (folder / "toy_backend_options.py").write_text(backend)
    checkpoint = tmp_path / "torch_dist"  # a torch_dist folder as megatron-core writes one (its two metadata files)
    checkpoint.mkdir(exist_ok=True)
    (checkpoint / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (checkpoint / ".metadata").write_bytes(b"")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(folder)]), "TOY_DECLARED": str(int(declared))}
    done = subprocess.run(
        [sys.executable, "-c", CAPABILITY_DRIVER, str(checkpoint)],
        env=env,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_what_a_new_engine_and_backend_can_do_is_their_declaration(tmp_path):
    # Mutations caught: a check that names engines or backends (the sglang/megatron lists these replaced) accepts the
    # undeclared toys or refuses the declared ones.
    engine = (
        "--rollout-top-p 0.9 replays each token's nucleus in training (slime's top-p replay), which --rollout-engine "
        "toy does not do (toy_engine_options does not declare REPORTS_TOP_P_NUCLEI = True): add "
        "--no-rollout-top-p-replay to train on untruncated log-probs"
    )
    backend = engine.replace("--rollout-engine toy", "--train-backend toy").replace(
        "toy_engine_options does not declare REPORTS_TOP_P_NUCLEI",
        "toy_backend_options does not declare REPLAYS_TOP_P_NUCLEI",
    )
    bare = _capabilities(tmp_path, declared=False)
    assert bare["top_p"] == {"hf/torch": [], "hf/toy": [backend], "toy/torch": [engine], "toy/toy": [engine, backend]}
    (refused,) = bare["ref_load"]
    assert refused.endswith(
        "the toy backend loads the reference from an HF folder (config.json and weights); Megatron torch_dist "
        "checkpoints need --train-backend megatron"
    )
    assert bare["colocate"] == []
    declared = _capabilities(tmp_path, declared=True)
    assert declared["top_p"] == {"hf/torch": [], "hf/toy": [], "toy/torch": [], "toy/toy": []}
    assert declared["ref_load"] == []
    assert declared["colocate"] == [
        "--colocate shares devices between trainers and --rollout-engine toy engines, which hold a fixed fraction of "
        "their GPU: it needs --offload-train"
    ]
