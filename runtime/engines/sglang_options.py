"""The SGLang engine's own options (``--rollout-engine sglang``: launched servers or running ones, behind the SGLang
router) and their rules. ``runtime.config`` composes :class:`SGLangOptions` into its ``sglang`` section
(``cfg.sglang.rollout_num_gpus_per_engine``) and :class:`SGLangRolloutOptions` into its ``rollout`` section, refuses
these flags under another engine (from :data:`OWN_FIELDS`), and runs :func:`check` when this engine is chosen.
``sglang_args`` / ``router_args`` hold the ``--sglang-*`` / ``--router-*`` passthrough flags by SGLang's own names
(``runtime.engines.sglang_flags``); they have no flag of their own."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from runtime.option_fields import described, own_fields, slime

_OWN = "a flag of the SGLang servers"


@dataclass(frozen=True)
class SGLangOptions:
    """The SGLang fleet: servers, router, their timeouts and passthrough flags."""

    OWN = _OWN

    rollout_num_gpus_per_engine: int = field(
        default=1,
        metadata=described(
            "GPUs per SGLang server (its tensor-parallel size); --rollout-num-gpus in all", slime=slime("cluster", 1)
        ),
    )
    rollout_external_engine_addrs: str | None = field(
        default=None,
        metadata=described(
            "use these running SGLang servers (comma- or space-separated host:port or URLs); no launch",
            slime=slime("rollout", None),
        ),
    )
    sglang_server_command: str = field(
        default="python -m sglang.launch_server",
        metadata=described("ours: the command that starts one SGLang server (the launcher appends its flags)"),
    )
    sglang_server_startup_timeout: float = field(
        default=600.0, metadata=described("ours: seconds a launched server may take to answer /health_generate")
    )
    sglang_router_ip: str | None = field(
        default=None,
        metadata=described(
            "use the running SGLang router at this address instead of launching one", slime=slime("sglang", None)
        ),
    )
    sglang_router_port: int | None = field(
        default=None, metadata=described("port of the router (with --sglang-router-ip)", slime=slime("sglang", None))
    )
    sglang_router_request_timeout_secs: int = field(
        default=14400, metadata=described("seconds the router waits for one request", slime=slime("sglang", 14400))
    )
    sglang_args: dict = field(
        default_factory=dict,
        metadata={
            **described("--sglang-<flag> values", own="SGLang server flags, passed through"),
            "passthrough": True,
            "flag": "--sglang-* flags",
        },
    )
    router_args: dict = field(
        default_factory=dict,
        metadata={
            **described("--router-<flag> values", own="SGLang router flags, passed through"),
            "passthrough": True,
            "flag": "--router-* flags",
        },
    )


@dataclass(frozen=True)
class SGLangRolloutOptions:
    """slime's alias of ``--rollout-external-engine-addrs``, in the rollout section where slime's scripts read it."""

    OWN = _OWN

    sglang_url: str | None = field(
        default=None,
        metadata=described(
            "alias of --rollout-external-engine-addrs (comma-separated base URLs)",
            own="an alias of --rollout-external-engine-addrs (running SGLang servers)",
        ),
    )


# Each section of the config this engine adds fields to.
OPTIONS: dict[str, type] = {"sglang": SGLangOptions, "rollout": SGLangRolloutOptions}
# Every flag this engine alone reads -> what it is (the refusal under another engine names it).
OWN_FIELDS: dict[str, str] = own_fields(SGLangOptions, SGLangRolloutOptions)
# Top-p replay (--rollout-top-p below 1) needs each token's nucleus from the engine: SGLang reports it only when
# patched (the refusal quotes the note).
REPORTS_TOP_P_NUCLEI = False
TOP_P_NUCLEI_NOTE = "SGLang reports each token's nucleus only with slime's sglang-top_p.patch, not applied here"


def check(problems: list[str], cfg: Any) -> None:
    """``--rollout-engine sglang``'s rules: the fleet's flags consistent with each other and with the job's GPUs."""
    from runtime.engines import sglang_flags
    from runtime.engines.registry import sglang_urls

    s, res = cfg.sglang, cfg.resources
    if cfg.rollout.sglang_url and s.rollout_external_engine_addrs:
        problems.append("--sglang-url is an alias of --rollout-external-engine-addrs: give one of them")
    for which, values in (("server", s.sglang_args), ("router", s.router_args)):
        problems.extend(sglang_flags.passthrough_problems(which, values))
    if s.rollout_num_gpus_per_engine < 1:
        problems.append(f"--rollout-num-gpus-per-engine must be >= 1, got {s.rollout_num_gpus_per_engine}")
    if s.rollout_num_gpus_per_engine >= 1 and res.rollout_num_gpus % s.rollout_num_gpus_per_engine:
        problems.append(
            f"--rollout-num-gpus {res.rollout_num_gpus} must be a multiple of --rollout-num-gpus-per-engine "
            f"{s.rollout_num_gpus_per_engine} (each engine takes that many)"
        )
    if not sglang_urls(cfg) and s.rollout_num_gpus_per_engine > res.num_gpus_per_node:
        problems.append(
            f"--rollout-num-gpus-per-engine {s.rollout_num_gpus_per_engine} > --num-gpus-per-node "
            f"{res.num_gpus_per_node}: an engine would span nodes, and rlcore launches single-node SGLang servers only"
        )
    if s.update_weight_transport == "ipc" and s.rollout_num_gpus_per_engine > 1:
        problems.append(
            "--update-weight-transport ipc is built for one GPU per SGLang engine: with --rollout-num-gpus-per-engine "
            "> 1 give nccl or disk (unset under --colocate: disk)"
        )
    if (s.sglang_router_ip is None) != (s.sglang_router_port is None):
        problems.append("--sglang-router-ip and --sglang-router-port go together (the address of a running router)")
    if s.sglang_router_port is not None and not 0 < s.sglang_router_port < 65536:
        problems.append(f"--sglang-router-port must be in [1, 65535], got {s.sglang_router_port}")
    if s.sglang_router_ip is not None and s.router_args:
        problems.append("--router-* flags configure the router rlcore launches: not with --sglang-router-ip")
    if s.sglang_router_request_timeout_secs <= 0 or s.sglang_server_startup_timeout <= 0:
        problems.append("--sglang-router-request-timeout-secs and --sglang-server-startup-timeout must be > 0")
    if not s.sglang_server_command.split():
        problems.append("--sglang-server-command must not be empty")
    if s.sglang_router_ip is None and importlib.util.find_spec("sglang_router") is None:
        problems.append(
            "--rollout-engine sglang launches the SGLang router, which needs the sglang-router package "
            "(pip install 'rlcore[sglang]'), or give a running one with --sglang-router-ip/--sglang-router-port"
        )
