"""A real 2-process DDP RLOO step on CPU (gloo): leave-one-out groups split over the ranks, the KL penalty gathered.

Run by ``tests/test_rloo.py`` as ``python ddp_rloo.py OUT_DIR``. Lightning's subprocess launcher re-executes this
file for rank 1, so everything runs under ``if __name__ == "__main__"``.

Geometry: per-device batch 6, G = 4, one micro-step per optimizer step: a round is 12 rows = 3 prompts; rank 0 gets
4 x prompt 0 and 2 x prompt 1, rank 1 the other 2 x prompt 1 and 4 x prompt 2, so prompt 1's baseline needs the other
rank's rewards and KL. ``beta`` = 0.1 with the policy moved away from its reference (:func:`perturb`), so the KL is not
0. Output per rank ``r``: ``rank{r}.pt`` with the step's buffered rows and its synced gradient.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import transformers

from helpers.models import tiny_llama

PROMPTS, BATCH, G, BETA, MAX_COMPLETION = 3, 6, 4, 0.1, 4


def build_model() -> transformers.LlamaForCausalLM:
    """The tests' tiny Llama with an EOS-favouring output bias (varied completion lengths); seeded."""
    return tiny_llama(0, eos_bias=3.0)


def perturb(model: Any) -> Any:
    """Move the policy away from the reference, the same on every rank."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def length_reward(prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float]:
    """Kept completion tokens, + 2 when the completion ended with EOS (id 1)."""
    return [len(ids) + 2.0 * (ids[-1:] == [1]) for ids in completion_ids]


def prompt_texts() -> list[str]:
    return [f"{10 + i}+11=" for i in range(PROMPTS)]


if __name__ == "__main__":
    import lightning as L
    from datasets import Dataset, disable_progress_bars

    from lit_trainer.data.prompt import PromptDataModule
    from lit_trainer.modules.rloo import RLOOModule

    disable_progress_bars()
    out_dir = sys.argv[1]

    class Recorder(L.Callback):
        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
            self.grads = {n: p.grad.clone() for n, p in pl_module.model.named_parameters()}
            self.slices = [dict(s) for s in pl_module._buffer.slices]

    module = RLOOModule(
        build_model(), tokenizer=transformers.ByT5Tokenizer(), reward_funcs=[length_reward], num_generations=G,
        max_completion_length=MAX_COMPLETION, beta=BETA, learning_rate=1e-2, scheduler="constant", max_grad_norm=0.0,
        generation_seed=0,
    )  # fmt: skip
    perturb(module.model)  # the reference copy was taken before: it stays the initial weights
    dm = PromptDataModule(
        tokenizer=transformers.ByT5Tokenizer(), batch_size=BATCH, max_length=16, val_size=0, sampling="sequential",
        dataset=Dataset.from_dict({"prompt": prompt_texts(), "answer": ["0"] * PROMPTS}),
    )  # fmt: skip
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", strategy="ddp", devices=2, max_steps=1, enable_progress_bar=False, logger=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[recorder], num_sanity_val_steps=0,
        limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    torch.save(
        {"grads": recorder.grads, "slices": recorder.slices, "world_size": trainer.world_size},
        os.path.join(out_dir, f"rank{trainer.global_rank}.pt"),
    )
