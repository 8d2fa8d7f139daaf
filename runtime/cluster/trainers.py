"""The trainer group: one Ray actor per trainer rank, each wrapping the backend ``--train-backend`` names.

:class:`TrainerWorker` is the actor. It builds its backend inside its own process (from the registry, so the group
never names a backend class) and runs the composite steps that must not cross the driver: a rollout's training
(:func:`runtime.train.step.train_rollout`) and the trainer side of a weight sync. :class:`TrainerGroup` drives all
ranks as one: each call goes to every rank at once, and a batch goes out as one object ref that every rank reads.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
import torch
from tensordict import TensorDict

from rlcore.advantages import AdvantageConfig
from runtime.cluster.health import first_line
from runtime.cluster.placement import Placement, trainer_rendezvous
from runtime.engines import launcher, weight_transfer
from runtime.engines.sglang_engine import copy_model_files
from runtime.errors import JobError
from runtime.train.backends import backend_class
from runtime.train.batch import shard_rows
from runtime.train.hooks import TrainHooks
from runtime.train.memory import memory_history
from runtime.train.offload import reduce_over_ranks
from runtime.train.step import train_rollout

# Seconds the group waits for its other ranks once one call failed, to tell a dead rank from a failing call, and for
# live ranks to shut down (a rank whose peer died inside a collective may never answer).
SETTLE_TIMEOUT_S = 30
# How a weight-update bucket crosses the group: one flat buffer per bucket (SGLang's "flattened_bucket"), one
# broadcast instead of one per tensor (a 0.6B model has about 300).
WEIGHT_LOAD_FORMAT = weight_transfer.FLAT


class TrainerDied(JobError):
    """A trainer rank's process died (killed, out of memory, its node lost)."""

    def __init__(self, rank: int, err: BaseException):
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        detail = lines[0] if lines else ""
        if len(lines) > 1 and "creation task" in detail:  # Ray names the constructor's exception on the last line
            detail = f"its start failed: {lines[-1].strip()}"
        super().__init__(f"trainer rank {rank} died ({type(err).__name__}: {detail})")
        self.rank = rank


def _actor_died(err: BaseException) -> bool:
    return isinstance(err, ray.exceptions.RayActorError) and not isinstance(err, ray.exceptions.RayTaskError)


def device_memory() -> dict[str, int] | None:
    """``{"peak": max reserved bytes of this process, "total": its device's bytes}``, None without CUDA."""
    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    return {
        "peak": torch.cuda.max_memory_reserved(device),
        "total": torch.cuda.get_device_properties(device).total_memory,
    }


class TrainerWorker:
    """One trainer rank: a backend plus the steps that run next to it (see the module docstring)."""

    def __init__(self, backend: str, model_path: str, *, debug: Any = None, **backend_kwargs: Any):
        self.model_path = model_path
        # slime's --record-memory-history: started before the model is built, so its allocations are in it.
        self.memory = memory_history(debug, rank=backend_kwargs.get("rank", 0)) if debug is not None else None
        self.backend = backend_class(backend)(model_path, **backend_kwargs)
        # slime's trainer-side hooks (runtime.train.hooks): the backend has its own; the rollout-level ones run here.
        self.hooks = backend_kwargs.get("hooks") or TrainHooks()
        self.resolved = self.hooks.resolve()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A :class:`runtime.train.backends.base.TrainBackend` method by name."""
        return getattr(self.backend, method)(*args, **kwargs)

    def device_memory(self) -> dict[str, int] | None:
        """This process's peak of reserved GPU memory and its device's total (bytes); None without a GPU."""
        return device_memory()

    def train_rollout(
        self,
        batch: TensorDict,
        *,
        global_batch_size: int,
        adv_cfg: AdvantageConfig,
        use_rollout_log_probs: bool = False,
        train_actor: bool = True,
        rollout_id: int | None = None,
    ) -> dict[str, float]:
        metrics = train_rollout(
            self.backend,
            batch,
            global_batch_size=global_batch_size,
            adv_cfg=adv_cfg,
            use_rollout_log_probs=use_rollout_log_probs,
            train_actor=train_actor,
            rollout_id=rollout_id,
            hooks=self.hooks,
            resolved=self.resolved,
        )
        if self.memory is not None and rollout_id is not None:
            path = self.memory.step(rollout_id)
            if path is not None:
                print(f"rlcore-run: CUDA memory snapshot of rollout {rollout_id} written to {path}", flush=True)
        return metrics

    def sft_train(self, batch: TensorDict) -> dict[str, float]:
        dp_rank, dp_size = self.backend.dp_info()
        n = batch.batch_size[0]
        return self.backend.sft_train(batch[shard_rows(n, global_batch_size=n, dp_rank=dp_rank, dp_size=dp_size)])

    def push_buckets(self, engines: list[Any], *, version: int, dtype: str, bucket_bytes: int) -> int:
        """Send the weights to ``engines`` bucket by bucket through the object store (each bucket put once, read by
        every engine); the last bucket carries ``version``. Every rank joins the gather; returns the bytes sent."""
        sent = 0
        previous = None
        for bucket in self.backend.weight_buckets(dtype=getattr(torch, dtype), bucket_bytes=bucket_bytes):
            # One bucket is held back so that the last one, and only it, can carry the version.
            if previous is not None:
                sent += self._send(engines, previous, version=None)
            previous = bucket
        if previous is not None:
            sent += self._send(engines, previous, version=version)
        return sent

    @staticmethod
    def _send(engines: list[Any], bucket: dict[str, torch.Tensor], *, version: int | None) -> int:
        ref = ray.put(bucket)
        ray.get([e.load_weights.remote(ref, weight_version=version) for e in engines])
        return sum(t.nbytes for t in bucket.values())

    def share_buckets(self, engines: list[Any], *, version: int, dtype: str, bucket_bytes: int) -> int:
        """Send the weights to colocated ``engines`` as handles to this process's memory (CUDA IPC on a GPU, shared
        memory on the CPU; ``update_weights_from_tensor``), bucket by bucket, each kept alive until every engine has
        copied it; the last bucket carries ``version``. Every rank joins the gather; returns the bytes shared."""
        sent = 0
        previous = None
        for bucket in self.backend.weight_buckets(
            dtype=getattr(torch, dtype), bucket_bytes=bucket_bytes, device="model"
        ):
            if previous is not None:
                sent += self._share(engines, previous, version=None)
            previous = bucket
        if previous is not None:
            sent += self._share(engines, previous, version=version)
        return sent

    @staticmethod
    def _share(engines: list[Any], bucket: dict[str, torch.Tensor], *, version: int | None) -> int:
        payload = weight_transfer.serialize_named_tensors(list(bucket.items()))
        ray.get([e.update_weights_from_tensor.remote(payload, weight_version=version) for e in engines])
        return sum(t.nbytes for t in bucket.values())

    def weight_group_address(self) -> tuple[str, int, str]:
        """Where this rank hosts a weight-update group (its node's address, a free port) and the backend it takes:
        NCCL when it has a GPU, gloo otherwise."""
        host = ray.util.get_node_ip_address()
        return host, launcher.free_port(host), "nccl" if torch.cuda.is_available() else "gloo"

    def init_weight_group(
        self, *, master_address: str, master_port: int, world_size: int, group_name: str, backend: str
    ):
        """Join (as rank 0, hosting the rendezvous) the weight-update group the engines join too."""
        self._weight_group = weight_transfer.init_weights_update_group(
            master_address=master_address,
            master_port=master_port,
            rank=0,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        self._weight_device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"

    def broadcast_buckets(
        self,
        engines: list[Any],
        *,
        version: int,
        dtype: str,
        bucket_bytes: int,
        group_name: str,
        method: str = "update_weights_from_distributed",
    ) -> list[int]:
        """Send the weights to ``engines`` over the weight-update group, bucket by bucket: each engine is told a
        bucket's names, dtypes and shapes (``method``: ``update_weights_from_distributed``, or
        ``stage_weights_from_distributed`` into a second buffer while it generates) while this rank broadcasts its
        tensors; the last bucket carries ``version``. Every rank joins the gather; returns the bytes of each bucket
        sent.

        Each bucket is packed into one flat buffer and sent in one broadcast (:data:`WEIGHT_LOAD_FORMAT`; the engines
        unpack views of it). Over NCCL the buckets stay on this rank's GPU in the engines' dtype (no host copy), and
        the broadcast of one bucket runs while the next is gathered, cast and packed: a bucket is waited on (its
        broadcast done, every engine loaded it) only once the next one is in flight, so at most two buckets are held
        at a time."""
        on_gpu = getattr(self, "_weight_device", "cpu") != "cpu"
        buckets = self.backend.weight_buckets(
            dtype=getattr(torch, dtype), bucket_bytes=bucket_bytes, device="model" if on_gpu else "cpu"
        )
        if not engines:  # a rank other than 0: it joins the gather (the buckets' collectives) and sends nothing
            for _ in buckets:
                pass
            return []
        sizes: list[int] = []
        in_flight = None
        previous = None
        for bucket in buckets:
            # One bucket is held back so that the last one, and only it, can carry the version.
            if previous is not None:
                started = self._start_broadcast(engines, previous, None, group_name, method)
                if in_flight is not None:
                    sizes.append(self._finish_broadcast(in_flight))
                in_flight = started
            previous = bucket
        if previous is not None:
            started = self._start_broadcast(engines, previous, version, group_name, method)
            if in_flight is not None:
                sizes.append(self._finish_broadcast(in_flight))
            sizes.append(self._finish_broadcast(started))
        return sizes

    def _start_broadcast(
        self, engines: list[Any], bucket: dict[str, torch.Tensor], version: int | None, group_name: str, method: str
    ) -> tuple[int, list[ray.ObjectRef], weight_transfer.Sending]:
        names, dtypes, shapes = weight_transfer.bucket_meta(bucket)
        fmt = WEIGHT_LOAD_FORMAT
        refs = [
            getattr(e, method).remote(
                names, dtypes, shapes, group_name=group_name, weight_version=version, load_format=fmt
            )
            for e in engines
        ]
        try:
            sending = weight_transfer.start_bucket(
                self._weight_group, bucket, device=self._weight_device, load_format=fmt
            )
        except BaseException:
            self._abandon_weight_group()
            raise
        return sum(t.nbytes for t in bucket.values()), refs, sending

    def _finish_broadcast(self, started: tuple[int, list[ray.ObjectRef], weight_transfer.Sending]) -> int:
        size, refs, sending = started
        try:
            weight_transfer.finish_bucket(self._weight_group, sending, failed=lambda: _first_failure(refs))
        except BaseException:
            self._abandon_weight_group()
            raise
        ray.get(refs)
        return size

    def _abandon_weight_group(self) -> None:
        # Aborted: the weight sync forms a new group under a new name. This one is kept, not destroyed: an operation
        # may still wait in it (gloo's abort does not end one stuck on a hung peer).
        if self._weight_group is not None:
            self._abandoned_groups = [*getattr(self, "_abandoned_groups", []), self._weight_group]
        self._weight_group = None

    def destroy_weight_group(self) -> None:
        group, self._weight_group = getattr(self, "_weight_group", None), None
        if group is not None:
            weight_transfer.destroy_group(group)

    def write_weights(self, folder: str, *, dtype: str, bucket_bytes: int) -> str | None:
        """Write the weights as an HF folder (one safetensors file per bucket plus their index, and the checkpoint's
        config and tokenizer files) that engines load with ``update_weights_from_disk``; rank 0 returns its path."""
        from safetensors.torch import save_file

        out = Path(folder)
        weight_map: dict[str, str] = {}
        files = []
        for i, bucket in enumerate(
            self.backend.weight_buckets(dtype=getattr(torch, dtype), bucket_bytes=bucket_bytes)
        ):
            files.append((f"model-{i + 1:05d}.safetensors", bucket))
        if not files:
            return None
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for name, bucket in files:
            save_file({k: v.contiguous() for k, v in bucket.items()}, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(bucket, name))
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        copy_model_files(self.model_path, out)
        return str(out)


def _with_env(options: dict[str, Any], env_vars: Mapping[str, str]) -> dict[str, Any]:
    """Ray actor ``options`` with ``env_vars`` added to (and overriding) those of its ``runtime_env``."""
    runtime_env = dict(options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **env_vars}
    return {**options, "runtime_env": runtime_env}


class TrainerGroup:
    """The trainer ranks of one model role group, driven as one (every method runs on every rank at once)."""

    def __init__(
        self,
        placement: Placement,
        *,
        backend: str,
        model_path: str,
        env_vars: Mapping[str, str] | None = None,
        **backend_kwargs: Any,
    ):
        """``env_vars`` (slime's ``--train-env-vars``) are set in every trainer process, over the placement's own."""
        world_size = len(placement.trainer_bundles)
        # 127.0.0.1 on one node; rank 0's node IP when the trainer bundles span nodes. No ranks: --debug-rollout-only.
        address, port = trainer_rendezvous(placement) if world_size else ("127.0.0.1", 0)
        remote_cls = ray.remote(TrainerWorker)
        self.actors = [
            remote_cls.options(**_with_env(placement.options(bundle), env_vars or {})).remote(
                backend,
                model_path,
                rank=rank,
                world_size=world_size,
                master_addr=address,
                master_port=port,
                **backend_kwargs,
            )
            for rank, bundle in enumerate(placement.trainer_bundles)
        ]
        # The step whose weights the trainers hold (the loop sets it after a load and after every training step): a
        # restarted rollout engine takes the weights under this version.
        self.version = 0
        # Held while the weights and ``version`` change (a training step) and while a restarted engine takes them.
        self.weights_lock = threading.RLock()

    def _get(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """``ray.get(refs)`` (one ref per rank, in rank order), raising :class:`TrainerDied` when a rank's process
        died, also when another rank's error (a collective whose peer vanished) came first."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as err:
            if _actor_died(err):
                rank = next((r for r, ref in enumerate(refs) if _failed_by_death(ref)), 0)
                raise TrainerDied(rank, err) from None
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=SETTLE_TIMEOUT_S)
            for rank, ref in enumerate(refs):
                if ref in ready and _failed_by_death(ref):
                    raise TrainerDied(rank, err) from None
            raise

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """A backend method on every rank; each rank's result, in rank order."""
        return self._get([a.call.remote(method, *args, **kwargs) for a in self.actors])

    def train_rollout(
        self,
        batch: TensorDict,
        *,
        global_batch_size: int,
        adv_cfg: AdvantageConfig,
        use_rollout_log_probs: bool = False,
        train_actor: bool = True,
        rollout_id: int | None = None,
    ) -> dict[str, float]:
        """Train every rank on its shard of ``batch``, which goes out once, as one object ref (``train_actor`` False:
        the critic only, slime's ``--num-critic-only-steps``; ``rollout_id`` for the memory snapshots)."""
        ref = ray.put(batch)
        kwargs = {
            "global_batch_size": global_batch_size,
            "adv_cfg": adv_cfg,
            "train_actor": train_actor,
            "rollout_id": rollout_id,
        }
        outs = self._get(
            [a.train_rollout.remote(ref, use_rollout_log_probs=use_rollout_log_probs, **kwargs) for a in self.actors]
        )
        return outs[0]

    def sft_train(self, batch: TensorDict) -> dict[str, float]:
        ref = ray.put(batch)
        return self._get([a.sft_train.remote(ref) for a in self.actors])[0]

    def push_buckets(self, engines: list[Any], *, version: int, dtype: str, bucket_bytes: int) -> int:
        # Only rank 0 holds gathered weights; handing the engines to the others would make them send nothing anyway.
        outs = self._get(
            [
                a.push_buckets.remote(
                    engines if rank == 0 else [], version=version, dtype=dtype, bucket_bytes=bucket_bytes
                )
                for rank, a in enumerate(self.actors)
            ]
        )
        return outs[0]

    def share_buckets(self, engines: list[Any], *, version: int, dtype: str, bucket_bytes: int) -> int:
        """Every rank gathers the weights onto its device and shares them with the engine colocated there (engine
        ``r`` shares rank ``r``'s bundle); with one engine per trainer rank, or all engines from rank 0 otherwise
        (the CPU, where shared memory reaches every process). Returns the bytes rank 0 shared."""
        per_rank = len(engines) == len(self.actors)
        outs = ray.get(
            [
                a.share_buckets.remote(
                    [engines[rank]] if per_rank else (engines if rank == 0 else []),
                    version=version,
                    dtype=dtype,
                    bucket_bytes=bucket_bytes,
                )
                for rank, a in enumerate(self.actors)
            ]
        )
        return outs[0]

    def weight_group_address(self) -> tuple[str, int, str]:
        return ray.get(self.actors[0].weight_group_address.remote())

    def init_weight_group(self, **kwargs: Any) -> ray.ObjectRef:
        """Rank 0 joins the weight-update group; returns the call's ref (it blocks until the engines join too)."""
        return self.actors[0].init_weight_group.remote(**kwargs)

    def broadcast_buckets(
        self,
        engines: list[Any],
        *,
        version: int,
        dtype: str,
        bucket_bytes: int,
        group_name: str,
        method: str = "update_weights_from_distributed",
    ) -> list[int]:
        # Every rank gathers; only rank 0 holds the weights, joins the group and talks to the engines.
        outs = self._get(
            [
                a.broadcast_buckets.remote(
                    engines if rank == 0 else [],
                    version=version,
                    dtype=dtype,
                    bucket_bytes=bucket_bytes,
                    group_name=group_name,
                    method=method,
                )
                for rank, a in enumerate(self.actors)
            ]
        )
        return outs[0]

    def destroy_weight_group(self) -> None:
        ray.get(self.actors[0].destroy_weight_group.remote())

    def write_weights(self, folder: str, *, dtype: str, bucket_bytes: int) -> str:
        return self._get(
            [a.write_weights.remote(folder, dtype=dtype, bucket_bytes=bucket_bytes) for a in self.actors]
        )[0]

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The full float32 weights (rank 0's gather; tied weights once), for tests and exports."""
        return self.call("get_weights")[0]

    def save(self, path: str, *, with_optimizer: bool = True) -> None:
        self.call("save", path, with_optimizer=with_optimizer)

    def load(self, path: str) -> None:
        self.call("load", path)

    def save_hf(self, path: str) -> None:
        self.call("save_hf", path)

    def write_lora_adapter(self, folder: str) -> str:
        """The LoRA adapters as a peft folder at ``folder`` (rank 0 writes it); its path."""
        return self.call("write_lora_adapter", folder)[0]

    def release_memory(self) -> dict[str, float]:
        """Every rank gives its device memory back; their offload metrics combined as each declares."""
        return reduce_over_ranks(self.call("release_memory"))

    def device_memory(self) -> list[dict[str, int] | None]:
        """Each rank's :func:`device_memory`."""
        return ray.get([a.device_memory.remote() for a in self.actors])

    def resume_memory(self) -> dict[str, float]:
        return reduce_over_ranks(self.call("resume_memory"))

    def shutdown(self) -> None:
        # Best effort: this runs while a failed job unwinds, when an actor may already be dead, or stuck in a
        # collective with a dead one.
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get([a.call.remote("shutdown") for a in self.actors], timeout=SETTLE_TIMEOUT_S)
        for a in self.actors:
            ray.kill(a)


def _first_failure(refs: list[ray.ObjectRef]) -> str | None:
    """Why the first of the finished calls ``refs`` (one per engine) failed, None while none has: an engine whose
    receive failed, or whose process died, leaves a broadcast that cannot complete."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayError as err:
            return f"engine {refs.index(ref)}'s receive failed ({first_line(err)})"
    return None


def _failed_by_death(ref: ray.ObjectRef) -> bool:
    """Whether the finished call ``ref`` failed because its actor's process died."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.GetTimeoutError:
        return False
    except ray.exceptions.RayError as err:
        return _actor_died(err)
    return False
