"""Per-rank bytes of parameters + gradients + AdamW state under ``ModelParallelStrategy`` (FSDP2): 1 vs 2 ranks.

    OMP_NUM_THREADS=1 python benchmarks/fsdp_memory.py [--model tiny-256]

Runs a 2-step ``CausalLMModule`` fit on CPU (gloo) with ``devices=1`` and then ``devices=2`` (each in its own
launch), and after the last step counts, on every rank, the bytes of the LOCAL tensors it holds: parameter shards,
gradient shards and the optimizer's ``exp_avg``/``exp_avg_sq`` shards (``DTensor.to_local()``). This is the memory
sharding divides; activations and the transient all-gathered block are not counted (they depend on the batch and on
one block's size, not on the model's). Prints a table and the 2-rank / 1-rank ratio (expected about 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    from lit_trainer.core.sharding import local

    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def _measure(devices: int, model: str, out: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lit_trainer.data.sft import SFTDataModule
    from lit_trainer.modules.causal_lm import CausalLMModule

    module = CausalLMModule(model, learning_rate=1e-3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        strategy=ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=SFTDataModule(batch_size=4, max_length=32, val_size=0))
    params = list(module.parameters())
    optimizer = trainer.optimizers[0]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
    row = {
        "rank": trainer.global_rank,
        "params": _local_bytes(params),
        "grads": _local_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer": _local_bytes(state),
    }
    (out / f"d{devices}_rank{trainer.global_rank}.json").write_text(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-256")
    parser.add_argument("--devices", type=int, default=None, help=argparse.SUPPRESS)  # one launch
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.devices is not None:
        _measure(args.devices, args.model, Path(args.out))
        return
    out = Path(tempfile.mkdtemp())
    for devices in (1, 2):
        subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--devices", str(devices), "--out", str(out)],
            check=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    rows = {d: [json.loads((out / f"d{d}_rank{r}.json").read_text()) for r in range(d)] for d in (1, 2)}
    print(f"model {args.model}: per-rank bytes after 2 AdamW steps (local shards)")
    print("| ranks | rank | parameters | gradients | optimizer state | total |\n|---:|---:|---:|---:|---:|---:|")
    for d, ranks in rows.items():
        for r in ranks:
            total = r["params"] + r["grads"] + r["optimizer"]
            print(f"| {d} | {r['rank']} | {r['params']:,} | {r['grads']:,} | {r['optimizer']:,} | {total:,} |")
    one = sum(rows[1][0][k] for k in ("params", "grads", "optimizer"))
    two = max(sum(r[k] for k in ("params", "grads", "optimizer")) for r in rows[2])
    print(f"largest 2-rank total / 1-rank total = {two / one:.3f}")


if __name__ == "__main__":
    main()
