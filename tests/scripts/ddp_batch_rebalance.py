"""A real 2-process DDP fit on CPU (gloo) with ``BatchRebalanceSampler`` and ``accumulate_grad_batches=2``.

Run by ``tests/test_ddp_batch_rebalance.py`` as ``python ddp_batch_rebalance.py OUT_DIR``. Lightning's subprocess
launcher re-executes this file for rank 1, so everything runs under ``if __name__ == "__main__"``.

Each rank trains a tiny float64 next-token model on rows that carry their dataset index (``idx``), fed by
``TrainLoader(dataset, BatchRebalanceSampler(...), collate)`` with Lightning's default
``use_distributed_sampler=True`` (the loader is not a ``DataLoader``, so Lightning must leave it alone). The loss is
token-exact: ``sum of token losses / all-reduced window token count * world_size * accumulate_grad_batches``.

Outputs in OUT_DIR:
    ``rank{r}.json``: loader/sampler facts and, per micro-batch, ``(epoch, global_step, batch_idx, idx)``;
    ``grads.pt`` (rank 0): per optimizer step, the parameters before the step, the gradient the step used, and the
    full-batch token-mean gradient computed here on the union over ranks of the step's samples.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from torch import nn

N_ROWS, BATCH_SIZE, ACCUMULATE, EPOCHS, SEED, VOCAB, DIM = 26, 3, 2, 2, 11, 16, 8


def row_lengths() -> list[int]:
    """Deterministic, varied lengths 2..14."""
    return [2 + (7 * i + 3) % 13 for i in range(N_ROWS)]


class Rows(torch.utils.data.Dataset):
    """Row ``i``: ``length(i)`` random tokens (seeded by ``i``), its next-token targets, and ``idx = i``."""

    def __init__(self) -> None:
        self.lengths = row_lengths()

    def __len__(self) -> int:
        return N_ROWS

    def __getitem__(self, i: int) -> dict[str, Any]:
        tokens = torch.randint(0, VOCAB, (self.lengths[i] + 1,), generator=torch.Generator().manual_seed(i))
        return {"idx": i, "input_ids": tokens[:-1], "targets": tokens[1:]}


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    targets = torch.full((len(rows), width), -100, dtype=torch.long)
    for k, row in enumerate(rows):
        ids[k, : len(row["input_ids"])] = row["input_ids"]
        targets[k, : len(row["targets"])] = row["targets"]
    return {"idx": torch.tensor([r["idx"] for r in rows]), "input_ids": ids, "targets": targets}


def count_items(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["targets"] != -100).sum()


class TinyLM(nn.Module):
    """A plain torch model (not a LightningModule): the script also runs it in float64 for the reference gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(input_ids)))


def token_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"])
    return nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100, reduction="sum"
    )


def full_batch_gradient(params: list[torch.Tensor], indices: list[int]) -> list[torch.Tensor]:
    """Gradient of the token-mean loss over ``indices`` at ``params``, computed in one pass."""
    model = TinyLM().double()
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
    batch = collate([Rows()[i] for i in indices])
    loss = token_loss_sum(model, batch) / count_items(batch)
    return list(torch.autograd.grad(loss, list(model.parameters())))


if __name__ == "__main__":
    import lightning as L
    from typing_extensions import override

    from lit_trainer.data.loader import TrainLoader
    from lit_trainer.data.samplers.rebalance_sampler import BatchRebalanceSampler

    class Recorder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyLM()
            self.records: list[dict[str, Any]] = []
            self.captures: list[dict[str, Any]] = []
            self.loader: TrainLoader | None = None

        @override
        def train_dataloader(self) -> TrainLoader:
            sampler = BatchRebalanceSampler(row_lengths(), BATCH_SIZE, accumulate_grad_batches=ACCUMULATE, seed=SEED)
            self.loader = TrainLoader(
                Rows(), sampler, collate, count_items=count_items, accumulate_grad_batches=ACCUMULATE, seed=SEED
            )
            return self.loader

        @override
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            window = self.trainer.strategy.reduce(batch["num_items_in_batch"].to(torch.float64), reduce_op="sum")
            self.records.append(
                {
                    "epoch": self.current_epoch,
                    "step": self.global_step,
                    "batch_idx": batch_idx,
                    "idx": batch["idx"].tolist(),
                }
            )
            return token_loss_sum(self.model, batch) / window * self.trainer.world_size * ACCUMULATE

        @override
        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            if self.global_rank == 0:
                self.captures.append(
                    {
                        "step": self.global_step,
                        "params": [p.detach().clone() for p in self.model.parameters()],
                        "grads": [p.grad.detach().clone() for p in self.model.parameters()],
                    }
                )

        @override
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    out_dir = sys.argv[1]
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        precision="64-true",
        max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUMULATE,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    module = Recorder()
    trainer.fit(module)
    loader = trainer.train_dataloader
    rank = trainer.global_rank
    facts = {
        "world_size": trainer.world_size,
        "loader_untouched": loader is module.loader,
        "loader_type": type(loader).__name__,
        "sampler_type": type(loader.batch_sampler).__name__,
        "sampler_replicas": loader.batch_sampler.num_replicas,
        "sampler_rank": loader.batch_sampler.rank,
        "global_step": trainer.global_step,
        "records": module.records,
    }
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(facts, f)
    os.replace(path + ".tmp", path)

    trainer.strategy.barrier()  # rank 1's record is written
    if rank == 0:  # compute the full-batch gradients of every step
        with open(os.path.join(out_dir, "rank1.json")) as f:
            records = module.records + json.load(f)["records"]
        results = []
        for capture in module.captures:
            union = sorted(i for r in records if r["step"] == capture["step"] for i in r["idx"])
            results.append({**capture, "union": union, "full": full_batch_gradient(capture["params"], union)})
        torch.save(results, os.path.join(out_dir, "grads.pt"))
