"""A real 2-process DDP GRPO run on CPU (gloo): ranks generate for their own prompts, gathered advantages, resume.

Run by ``tests/test_ddp_grpo.py`` as ``python ddp_grpo.py OUT_DIR``. Lightning's subprocess launcher re-executes this
file for rank 1, so everything runs under ``if __name__ == "__main__"``.

Geometry: per-device batch 3, G = 8, accumulate 2, steps_per_generation 4 -> generation batch 3 x 2 x 4 = 24 rows =
3 prompts per round; each rank gets 12 contiguous rows (rank 0: 8 x prompt 0 and 4 x prompt 1; rank 1: 4 x prompt 1
and 8 x prompt 2), so prompt 1's group is split over the ranks and its advantages need the gathered rewards. A round
is 4 micro-steps = 2 optimizer steps.

Phase 1 ("full"): 4 optimizer steps, a checkpoint after every step. Phase 2 ("resumed"): resume from the step-1
checkpoint, which is in the middle of round 0 (the checkpoint holds every rank's buffer), and train to step 4 (round
1 is generated after the resume), so its weights can be compared with phase 1's.

Outputs in OUT_DIR, per rank ``r``: ``rank{r}.json`` (prompts of every generate call, steps) and ``rank{r}.pt``
(round 0 before shuffling: completion ids and advantages; at step 0: the buffered slices and the synced gradient).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import transformers

from helpers.models import tiny_llama

PROMPTS, BATCH, G, ACCUMULATE, SPG, STEPS = 16, 3, 8, 2, 4, 4


def build_model() -> transformers.LlamaForCausalLM:
    """The tests' tiny Llama with an EOS-favouring output bias (varied completion lengths); seeded."""
    return tiny_llama(0, eos_bias=3.0)


def length_reward(prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float]:
    """Kept completion tokens, + 2 when the completion ended with EOS (id 1)."""
    return [len(ids) + 2.0 * (ids[-1:] == [1]) for ids in completion_ids]


def prompt_texts() -> list[str]:
    return [f"{10 + i}+11=" for i in range(PROMPTS)]


if __name__ == "__main__":
    import lightning as L
    from datasets import Dataset, disable_progress_bars
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_trainer.data.prompt import PromptDataModule
    from lit_trainer.modules.grpo import GRPOModule

    disable_progress_bars()
    out_dir = sys.argv[1]

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.step0: dict[str, Any] = {}

        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step == 0:
                self.step0 = {
                    "grads": {n: p.grad.clone() for n, p in pl_module.model.named_parameters()},
                    "slices": [dict(s) for s in pl_module._buffer.slices],
                }

    def run(phase: str, ckpt_path: str | None, max_steps: int) -> None:
        module = GRPOModule(
            build_model(),
            tokenizer=transformers.ByT5Tokenizer(),
            reward_funcs=[length_reward],
            num_generations=G,
            steps_per_generation=SPG,
            max_completion_length=4,
            learning_rate=1e-2,
            scheduler="constant",
            max_grad_norm=0.0,
            generation_seed=0,
        )
        calls: list[list[str]] = []
        rounds: list[dict[str, Any]] = []
        inner_generate, inner_score = module.model.generate, module._score

        def generate(*args: Any, **kwargs: Any) -> torch.Tensor:
            ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
            calls.append(module.tokenizer.batch_decode([r[m.bool()] for r, m in zip(ids, mask)]))
            out = inner_generate(*args, **kwargs)
            rounds.append({"completion_ids": out[:, ids.shape[1] :].clone()})
            return out

        def score(batch: dict, completions: Any, *args: Any) -> Any:
            advantages, metrics = inner_score(batch, completions, *args)
            rounds[-1].update(
                advantages=advantages.clone(),
                ids=completions.ids.clone(),
                mask=completions.mask.clone(),
                reward=metrics["reward"].clone(),
            )
            return advantages, metrics

        module.model.generate, module._score = generate, score
        dm = PromptDataModule(
            tokenizer=transformers.ByT5Tokenizer(),
            batch_size=BATCH,
            max_length=16,
            val_size=0,
            sampling="sequential",
            dataset=Dataset.from_dict({"prompt": prompt_texts(), "answer": ["0"] * PROMPTS}),
        )
        recorder = Recorder()
        callbacks: list[L.Callback] = [recorder]
        if phase == "full":
            callbacks.append(
                ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"), every_n_train_steps=1, save_top_k=-1)
            )
        trainer = L.Trainer(
            accelerator="cpu",
            strategy="ddp",
            devices=2,
            max_steps=max_steps,
            accumulate_grad_batches=ACCUMULATE,
            enable_progress_bar=False,
            logger=False,
            enable_model_summary=False,
            enable_checkpointing=phase == "full",
            callbacks=callbacks,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
        rank = trainer.global_rank
        weights = {n: p.detach().clone() for n, p in module.model.named_parameters()}
        torch.save(
            {"rounds": rounds, "step0": recorder.step0, "weights": weights},
            os.path.join(out_dir, f"{phase}_rank{rank}.pt"),
        )
        facts = {
            "calls": calls,
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
            "loader": type(trainer.train_dataloader).__name__,
            "sampler_rank": trainer.train_dataloader.batch_sampler.sampler.rank,
        }
        with open(os.path.join(out_dir, f"{phase}_rank{rank}.json"), "w") as f:
            json.dump(facts, f)

    run("full", None, STEPS)
    run("resumed", os.path.join(out_dir, "ckpt", "epoch=0-step=1.ckpt"), STEPS)
