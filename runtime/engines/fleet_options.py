"""The engines' fleet settings that are no one engine's own: requests in flight per engine through the router (read
by the engine group, ``runtime.cluster.engines``) and the offloads between rollout and training (read by
``runtime.colocation``). Torch-free: ``runtime.config`` composes :class:`FleetOptions` with the SGLang engine's
options (``runtime.engines.sglang_options``) and the weight syncs' (``runtime.cluster.weight_sync_options``) into
its ``sglang`` section, :class:`~runtime.config.SGLangConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.option_fields import bounded, described, slime


@dataclass(frozen=True)
class FleetOptions:
    """Requests in flight per engine and the offloads between rollout and training."""

    sglang_server_concurrency: int = field(
        default=512,
        metadata=bounded(
            gt=0,
            help="requests in flight per SGLang engine through the router (this x the engines in all)",
            slime=slime(
                "sglang", 512, note="requests in flight through the router: this x the engines (slime's semaphore)"
            ),
        ),
    )
    offload_rollout: bool | None = field(
        default=None,
        metadata=described(
            "release the engines' memory while training (weights back before a sync); unset: auto under --colocate "
            "(offload in the first step, then only if trainer and engine do not fit their device together; SGLang "
            "engines always), off otherwise",
            slime=slime("cluster", None, differs="unset under --colocate: auto, as --offload-train"),
        ),
    )
    offload_train: bool | None = field(
        default=None,
        metadata=described(
            "offload the trainers while the engines generate; unset: auto under --colocate (as --offload-rollout)",
            slime=slime(
                "cluster",
                None,
                differs="unset under --colocate: auto (offload in the first step, then "
                "only if needed; SGLang engines always)",
            ),
        ),
    )
    offload: bool = field(
        default=False,
        metadata=described(
            "--offload-train and --offload-rollout both on (slime's)",
            slime=slime(
                "cluster",
                False,
                differs="sets --offload-train and --offload-rollout; refused "
                "beside --no-offload-train/-rollout (slime lets it win)",
            ),
        ),
    )
