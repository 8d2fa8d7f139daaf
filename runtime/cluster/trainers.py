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
from pathlib import Path
from typing import Any

import ray
import torch
from tensordict import TensorDict

from rlcore.advantages import AdvantageConfig
from runtime.cluster.placement import Placement, free_port
from runtime.engines import launcher, weight_transfer
from runtime.engines.sglang_engine import copy_model_files
from runtime.train.backends import backend_class
from runtime.train.batch import shard_rows
from runtime.train.step import train_rollout


class TrainerWorker:
    """One trainer rank: a backend plus the steps that run next to it (see the module docstring)."""

    def __init__(self, backend: str, model_path: str, **backend_kwargs: Any):
        self.model_path = model_path
        self.backend = backend_class(backend)(model_path, **backend_kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A :class:`runtime.train.backends.base.TrainBackend` method by name."""
        return getattr(self.backend, method)(*args, **kwargs)

    def train_rollout(
        self,
        batch: TensorDict,
        *,
        global_batch_size: int,
        adv_cfg: AdvantageConfig,
        use_rollout_log_probs: bool = False,
    ) -> dict[str, float]:
        return train_rollout(
            self.backend,
            batch,
            global_batch_size=global_batch_size,
            adv_cfg=adv_cfg,
            use_rollout_log_probs=use_rollout_log_probs,
        )

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
        self, engines: list[Any], *, version: int, dtype: str, bucket_bytes: int, group_name: str
    ) -> list[int]:
        """Send the weights to ``engines`` over the weight-update group, bucket by bucket: each engine is told a
        bucket's names, dtypes and shapes (``update_weights_from_distributed``) while this rank broadcasts its tensors;
        the last bucket carries ``version``. Every rank joins the gather; returns the bytes of each bucket sent."""
        sizes = []
        previous = None
        for bucket in self.backend.weight_buckets(dtype=getattr(torch, dtype), bucket_bytes=bucket_bytes):
            if previous is not None:
                sizes.append(self._broadcast(engines, previous, version=None, group_name=group_name))
            previous = bucket
        if previous is not None:
            sizes.append(self._broadcast(engines, previous, version=version, group_name=group_name))
        return sizes

    def _broadcast(self, engines: list[Any], bucket: dict[str, torch.Tensor], *, version: int | None, group_name: str):
        names, dtypes, shapes = weight_transfer.bucket_meta(bucket)
        refs = [
            e.update_weights_from_distributed.remote(
                names, dtypes, shapes, group_name=group_name, weight_version=version
            )
            for e in engines
        ]
        sent = weight_transfer.send_bucket(self._weight_group, bucket, device=self._weight_device)
        ray.get(refs)
        return sent

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


class TrainerGroup:
    """The trainer ranks of one model role group, driven as one (every method runs on every rank at once)."""

    def __init__(self, placement: Placement, *, backend: str, model_path: str, **backend_kwargs: Any):
        world_size = len(placement.trainer_bundles)
        port = free_port()
        remote_cls = ray.remote(TrainerWorker)
        self.actors = [
            remote_cls.options(**placement.options(bundle)).remote(
                backend,
                model_path,
                rank=rank,
                world_size=world_size,
                master_addr="127.0.0.1",
                master_port=port,
                **backend_kwargs,
            )
            for rank, bundle in enumerate(placement.trainer_bundles)
        ]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """A backend method on every rank; each rank's result, in rank order."""
        return ray.get([a.call.remote(method, *args, **kwargs) for a in self.actors])

    def train_rollout(
        self,
        batch: TensorDict,
        *,
        global_batch_size: int,
        adv_cfg: AdvantageConfig,
        use_rollout_log_probs: bool = False,
    ) -> dict[str, float]:
        """Train every rank on its shard of ``batch``, which goes out once, as one object ref."""
        ref = ray.put(batch)
        kwargs = {"global_batch_size": global_batch_size, "adv_cfg": adv_cfg}
        outs = ray.get(
            [a.train_rollout.remote(ref, use_rollout_log_probs=use_rollout_log_probs, **kwargs) for a in self.actors]
        )
        return outs[0]

    def sft_train(self, batch: TensorDict) -> dict[str, float]:
        ref = ray.put(batch)
        return ray.get([a.sft_train.remote(ref) for a in self.actors])[0]

    def push_buckets(self, engines: list[Any], *, version: int, dtype: str, bucket_bytes: int) -> int:
        # Only rank 0 holds gathered weights; handing the engines to the others would make them send nothing anyway.
        outs = ray.get(
            [
                a.push_buckets.remote(
                    engines if rank == 0 else [], version=version, dtype=dtype, bucket_bytes=bucket_bytes
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
        self, engines: list[Any], *, version: int, dtype: str, bucket_bytes: int, group_name: str
    ) -> list[int]:
        # Every rank gathers; only rank 0 holds the weights, joins the group and talks to the engines.
        outs = ray.get(
            [
                a.broadcast_buckets.remote(
                    engines if rank == 0 else [],
                    version=version,
                    dtype=dtype,
                    bucket_bytes=bucket_bytes,
                    group_name=group_name,
                )
                for rank, a in enumerate(self.actors)
            ]
        )
        return outs[0]

    def destroy_weight_group(self) -> None:
        ray.get(self.actors[0].destroy_weight_group.remote())

    def write_weights(self, folder: str, *, dtype: str, bucket_bytes: int) -> str:
        return ray.get([a.write_weights.remote(folder, dtype=dtype, bucket_bytes=bucket_bytes) for a in self.actors])[
            0
        ]

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The full float32 weights (rank 0's gather; tied weights once), for tests and exports."""
        return self.call("get_weights")[0]

    def save(self, path: str, *, with_optimizer: bool = True) -> None:
        self.call("save", path, with_optimizer=with_optimizer)

    def load(self, path: str) -> None:
        self.call("load", path)

    def save_hf(self, path: str) -> None:
        self.call("save_hf", path)

    def release_memory(self) -> None:
        self.call("release_memory")

    def resume_memory(self) -> None:
        self.call("resume_memory")

    def shutdown(self) -> None:
        # Best effort: this runs while a failed job unwinds, when an actor may already be dead.
        with contextlib.suppress(ray.exceptions.RayError):
            self.call("shutdown")
        for a in self.actors:
            ray.kill(a)
