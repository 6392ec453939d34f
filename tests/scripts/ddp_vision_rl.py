"""2-process DDP (gloo) DPO and GRPO on ``tiny-vl`` with images: checked against one process by
``tests/test_vision_ddp_rl.py``.

Usage: python ddp_vision_rl.py OUT_DIR. Rows in the built-in shapes format (``lit_trainer.data.builtin_shapes``: one
32x32 picture per row, the question "How many red squares?"), drawn from its first pictures only (building the whole
built-in split takes ~10 s).

DPO: 16 preference pairs, per-device batch 2, accumulate 2, 2 optimizer steps at learning rate 0 (so each step's
gradient is that of the initial weights, comparable with a one-process full-batch gradient). Each rank writes
``dpo_rank<k>.pt``: the gradient before each optimizer step and every micro-batch it trained on (ids, masks, pixels).

GRPO: 8 prompts, per-device batch 2, G = 2, accumulate 2, steps_per_generation 2 (one round = one optimizer step),
2 optimizer steps at learning rate 1e-2, rewards ``arithmetic_reward`` + ``digit_reward``. Each rank writes
``grpo_rank<k>.pt``: the first step's buffered slices (prompt and completion ids, masks, advantages, per-row image
inputs) and synced gradient, and the final weights.
"""

from __future__ import annotations

import os
import sys
from typing import Any

PAIRS, PROMPTS, BATCH, ACCUMULATE, G = 16, 8, 2, 2, 2
DPO_BETA = 0.1


def shapes_rows(kind: str, count: int) -> Any:
    """``count`` rows of the built-in shapes task in its ``preference`` or ``prompt`` format (the first pictures of
    the training seed)."""
    from datasets import Dataset

    from lit_trainer.data import builtin_shapes as shapes

    data = shapes.pictures("train", count)
    rows: dict[str, list] = {"images": [[png] for png, _ in data], "prompt": [shapes._user() for _ in data]}
    if kind == "preference":
        rows["chosen"] = [shapes._assistant(str(red)) for _, red in data]
        rows["rejected"] = [shapes._assistant(str(red + 1 if red < 4 else red - 1)) for _, red in data]
    rows["answer"] = [str(red) for _, red in data]
    return Dataset.from_dict(rows)


def digit_reward(prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float]:
    """A reward that varies inside a group (arithmetic_reward is mostly 0 for an untrained model): the first
    completion token id modulo 7."""
    return [float(ids[0] % 7) if len(ids) else 0.0 for ids in completion_ids]


def trainer(callbacks: list, max_steps: int) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_steps=max_steps,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=callbacks,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


if __name__ == "__main__":
    import lightning.pytorch as pl
    import torch
    from ddp_vision import vision_model  # tests/scripts

    from helpers.accumulation import GradCapture
    from lit_trainer.data.preference import PreferenceDataModule
    from lit_trainer.data.prompt import PromptDataModule
    from lit_trainer.models import build_processor
    from lit_trainer.modules.dpo import DPOModule
    from lit_trainer.modules.grpo import GRPOModule
    from lit_trainer.rewards import arithmetic_reward

    out_dir = sys.argv[1]
    torch.set_num_threads(1)

    # ------------------------------------------------------------------------------------------------------ DPO
    dpo = DPOModule(vision_model(0), learning_rate=0.0, max_grad_norm=None, beta=DPO_BETA)
    capture, seen = GradCapture(), []

    class Batches(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append({k: v.clone() for k, v in batch.items() if torch.is_tensor(v)})

    dm = PreferenceDataModule(
        tokenizer="tiny-vl", dataset=shapes_rows("preference", PAIRS), batch_size=BATCH, max_length=64, val_size=0
    )
    fit = trainer([capture, Batches()], max_steps=2)
    fit.fit(dpo, datamodule=dm)
    torch.save({"grads": capture.grads, "seen": seen}, os.path.join(out_dir, f"dpo_rank{fit.global_rank}.pt"))

    # ----------------------------------------------------------------------------------------------------- GRPO
    class FirstStep(pl.Callback):
        def __init__(self) -> None:
            self.step0: dict[str, Any] = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if trainer.global_step == 0:
                self.step0 = {
                    "grads": {n: p.grad.clone() for n, p in pl_module.model.named_parameters() if p.grad is not None},
                    "slices": [dict(s) for s in pl_module._buffer.slices],
                }

    grpo = GRPOModule(
        vision_model(0),
        tokenizer=build_processor(),
        reward_funcs=[arithmetic_reward, digit_reward],
        num_generations=G,
        steps_per_generation=ACCUMULATE,
        max_completion_length=2,
        learning_rate=1e-2,
        scheduler="constant",
        max_grad_norm=0.0,
        generation_seed=0,
    )
    first = FirstStep()
    data = PromptDataModule(
        tokenizer="tiny-vl",
        dataset=shapes_rows("prompt", PROMPTS),
        batch_size=BATCH,
        max_length=64,
        val_size=0,
        sampling="sequential",
    )
    fit = trainer([first], max_steps=2)
    fit.fit(grpo, datamodule=data)
    weights = {n: p.detach().clone() for n, p in grpo.model.named_parameters()}
    result = {"step0": first.step0, "weights": weights, "global_step": fit.global_step}
    torch.save(result, os.path.join(out_dir, f"grpo_rank{fit.global_rank}.pt"))
