"""A 2-process DDP GRPO run on CPU (gloo) with TRL's tuning options on: ``top_entropy_quantile``, the adaptive entropy
bonus, ``sync_ref_model`` and ``log_completions``.

Run by ``tests/test_ddp_grpo_options.py`` as ``python ddp_grpo_options.py OUT_DIR``. Lightning's subprocess launcher
re-executes this file for rank 1, so everything runs under ``if __name__ == "__main__"``.

Geometry as ``ddp_grpo.py``: per-device batch 3, G = 8, accumulate 2, steps_per_generation 4 (old log-probs stored),
so a round is 4 micro-steps = 2 optimizer steps. beta 0.1 with the reference synced after every step (alpha 0.5);
entropy target 100 nats, so from step 1 on the bonus applies and its coefficient rises by 0.1 per step from 0.05.

Phase "full": 4 optimizer steps, a checkpoint after every step, a CSVLogger. Phase "resumed": from the step-1
checkpoint to step 4. Outputs per rank ``r``: ``{phase}_rank{r}.pt`` with the gradients, buffered slices and weights
(policy and reference) before the optimizer steps 0 and 1, the final weights and the entropy control's state.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import transformers

from helpers.models import tiny_llama

PROMPTS, BATCH, G, ACCUMULATE, SPG, STEPS = 16, 3, 8, 2, 4, 4
OPTIONS = {
    "top_entropy_quantile": 0.5, "use_adaptive_entropy": True, "entropy_coef": 0.05, "entropy_target": 100.0,
    "entropy_coef_delta": 0.1, "beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 1,
    "ref_model_mixup_alpha": 0.5, "log_completions": True,
}  # fmt: skip


def build_model() -> transformers.LlamaForCausalLM:
    return tiny_llama(0, eos_bias=3.0)


def length_reward(prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float]:
    return [len(ids) + 2.0 * (ids[-1:] == [1]) for ids in completion_ids]


def prompt_texts() -> list[str]:
    return [f"{10 + i}+11=" for i in range(PROMPTS)]


if __name__ == "__main__":
    import lightning as L
    import torch
    from datasets import Dataset, disable_progress_bars
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lit_trainer.data.prompt import PromptDataModule
    from lit_trainer.modules.grpo import GRPOModule

    disable_progress_bars()
    out_dir = sys.argv[1]

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.steps: dict[int, dict[str, Any]] = {}

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx % ACCUMULATE == 0 and trainer.global_step in (0, 1):  # the coefficient this step applies
                self.steps[trainer.global_step] = {"coef": pl_module._entropy.applied_coef()}

        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step in (0, 1):
                self.steps[trainer.global_step].update(
                    grads={n: p.grad.clone() for n, p in pl_module.model.named_parameters()},
                    slices=[dict(s) for s in pl_module._buffer.slices],
                    model=copy.deepcopy(pl_module.model.state_dict()),
                )

    def run(phase: str, ckpt_path: str | None) -> None:
        module = GRPOModule(
            build_model(), tokenizer=transformers.ByT5Tokenizer(), reward_funcs=[length_reward], num_generations=G,
            steps_per_generation=SPG, max_completion_length=4, learning_rate=1e-2, scheduler="constant",
            max_grad_norm=0.0, generation_seed=0, **OPTIONS,
        )  # fmt: skip
        dm = PromptDataModule(
            tokenizer=transformers.ByT5Tokenizer(), batch_size=BATCH, max_length=16, val_size=0, sampling="sequential",
            dataset=Dataset.from_dict({"prompt": prompt_texts()}),
        )  # fmt: skip
        recorder = Recorder()
        callbacks: list[L.Callback] = [recorder]
        if phase == "full":
            callbacks.append(
                ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"), every_n_train_steps=1, save_top_k=-1)
            )
        trainer = L.Trainer(
            accelerator="cpu", strategy="ddp", devices=2, max_steps=STEPS, accumulate_grad_batches=ACCUMULATE,
            enable_progress_bar=False, logger=CSVLogger(os.path.join(out_dir, phase)), log_every_n_steps=1,
            enable_model_summary=False, enable_checkpointing=phase == "full", callbacks=callbacks,
            num_sanity_val_steps=0, limit_val_batches=0,
        )  # fmt: skip
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
        torch.save(
            {
                "steps": recorder.steps,
                "weights": {n: p.detach().clone() for n, p in module.model.named_parameters()},
                "ref": {n: p.detach().clone() for n, p in module.ref_model.named_parameters()},
                "entropy": module._entropy.state_dict(),
                "global_step": trainer.global_step,
            },
            os.path.join(out_dir, f"{phase}_rank{trainer.global_rank}.pt"),
        )

    run("full", None)
    run("resumed", os.path.join(out_dir, "ckpt", "epoch=0-step=1.ckpt"))
