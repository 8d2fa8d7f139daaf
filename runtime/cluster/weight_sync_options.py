"""The rules of ``--update-weight-transport`` (the weight syncs of :mod:`runtime.cluster.weight_sync`), beside them:
torch-free, so the config checks a job before anything starts. (``ipc``'s need of ``--colocate`` is with the other
colocate rules, on the composed config: ``runtime.config.checks``; an SGLang engine's limit on ``ipc`` is in
``runtime.engines.sglang_options``.)"""

from __future__ import annotations

from typing import Any


def check(problems: list[str], cfg: Any) -> None:
    """The transport asked for can reach the engines from the trainers this job runs."""
    s, t = cfg.sglang, cfg.train
    if s.update_weight_transport == "lora_adapter":
        if t.lora_rank == 0 or cfg.rollout.rollout_engine != "sglang":
            problems.append(
                "--update-weight-transport lora_adapter pushes LoRA adapters to SGLang engines: it needs --lora-rank "
                "and --rollout-engine sglang"
            )
        if t.lora_modules_to_save:
            problems.append(
                "--update-weight-transport lora_adapter sends the adapters only: --lora-modules-to-save "
                f"{t.lora_modules_to_save!r} trains whole modules too (drop it, or push merged weights)"
            )
        if s.check_weight_update_equal:
            problems.append(
                "--check-weight-update-equal compares the engines' weights with the trainer's merged ones; under "
                "--update-weight-transport lora_adapter the engines keep the base weights and hold the adapter apart"
            )
    if s.update_weight_transport == "ipc" and t.train_backend == "megatron" and cfg.resources.num_trainer_procs > 1:
        problems.append(
            "--update-weight-transport ipc reaches one engine from the Megatron backend: with more than one trainer "
            "process give nccl or disk (unset under --colocate: disk)"
        )
