"""The colocated trainer's offload on one device: bytes moved and seconds to release and resume, bucketed through
pinned host buffers (``runtime.train.offload.HostOffload``, what the torch backend uses on one GPU) beside the
plain ``.to("cpu")`` of every module and optimizer tensor (what it does under FSDP, and did before).

    python3 tools/bench_offload.py                                # Qwen3-0.6B preset, AdamW state, on a GPU
    python3 tools/bench_offload.py --preset tiny --repeats 2      # a smoke run on the CPU (plain host buffers)

The actor's AdamW state is made by one optimizer step on zero gradients, so the trainer holds what it holds after
a real step: fp32 weights and two fp32 moments. Each way runs ``--repeats`` release/resume cycles; the first bucketed
one allocates the pinned buffers, later ones reuse them (the table shows both).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b", help="a tools/make_tiny_model.py preset, or tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=256)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.bucket_mib < 1:
        parser.error("--repeats and --bucket-mib must be >= 1")

    from runtime.config import from_dict, validate
    from runtime.demo import task
    from runtime.demo.tiny_model import make_preset_model, make_tiny_model
    from runtime.train.algo import loss_config
    from runtime.train.backends.torch_backend import TorchTrainer
    from runtime.train.offload import HostOffload
    from runtime.train.roles import ACTOR

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.preset == "tiny":
            path = str(make_tiny_model(f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        else:
            path = str(make_preset_model(args.preset, f"{tmp}/m", alphabet=task.ALPHABET, seed=0))
        cfg = validate(
            from_dict(
                None,
                hf_checkpoint=path,
                output_dir=f"{tmp}/out",
                num_rollout=1,
                rollout_batch_size=1,
                n_samples_per_prompt=8,
                global_batch_size=8,
                rollout_max_response_len=8,
                actor_num_gpus_per_node=1,
                use_kl_loss=False,
            )
        )
        trainer = TorchTrainer(
            path, train_cfg=cfg.train, loss_cfg=loss_config(cfg), temperature=1.0, seed=0, roles=(ACTOR,)
        )
        for p in trainer.model.parameters():
            p.grad = torch.zeros_like(p)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        cuda = trainer.device.type == "cuda"
        bucketed = HostOffload(trainer.device, bucket_bytes=args.bucket_mib * 2**20)
        for way, offload in (("bucketed, pinned", bucketed), (".to() per tensor", None)):
            trainer.host_offload = offload
            for cycle in range(args.repeats):
                if cuda:
                    torch.cuda.synchronize()
                before = torch.cuda.memory_allocated() if cuda else 0
                start = time.perf_counter()
                out = trainer.release_memory()
                release = time.perf_counter() - start
                freed = before - torch.cuda.memory_allocated() if cuda else float("nan")
                start = time.perf_counter()
                trainer.resume_memory()
                if cuda:
                    torch.cuda.synchronize()
                resume = time.perf_counter() - start
                moved = out.get("perf/offload_train_bytes", float("nan"))
                rows.append(
                    (
                        way,
                        str(cycle + 1),
                        f"{moved / 2**30:.2f}",
                        f"{freed / 2**30:.2f}",
                        f"{release:.3f}",
                        f"{resume:.3f}",
                        f"{moved / release / 1e9:.1f}" if moved == moved else "",
                    )
                )
                print(rows[-1], flush=True)
    print(f"\n{args.preset}, device {trainer.device}, buckets of {args.bucket_mib} MiB")
    print("| way | cycle | moved GiB | GPU freed GiB | release s | resume s | release GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
