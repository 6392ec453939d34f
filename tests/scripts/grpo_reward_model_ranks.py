"""GRPO with a reward model on 2 CPU ranks (gloo), under DDP and under ``ModelParallelStrategy`` (FSDP2), one launch.

Run for ``tests/test_grpo_reward_models.py`` as ``python grpo_reward_model_ranks.py OUT_DIR``, in the tests' shared
2-rank world (``helpers.ddp.WORLD``). Rank 0 first saves the test's seeded reward model (``saved_reward_model``) in
``OUT_DIR/rm``, the other rank waits for it (transformers writes a model only on rank 0 once a process group is up, as
it is in that world). Each rank records, per
generation round, the prompts and completions it scored (through a recording function reward beside the model) and
the round's gathered reward metrics, in ``OUT_DIR/{strategy}_rank{r}.pt``. One optimizer step per strategy:
2 prompts x 4 generations = 8 rows, 4 per rank.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

if __name__ == "__main__":
    import lightning as L
    import transformers
    from _fsdp_common import model_parallel
    from datasets import Dataset, disable_progress_bars
    from ddp_grpo import build_model, prompt_texts

    from lit_trainer.data.prompt import PromptDataModule
    from lit_trainer.modules.grpo import GRPOModule

    disable_progress_bars()
    out_dir = sys.argv[1]
    reward_model_dir, saved = os.path.join(out_dir, "rm"), os.path.join(out_dir, "rm.saved")
    if os.environ.get("LOCAL_RANK", "0") == "0":  # alone, rank 1 starts at the first fit: after this
        from test_grpo_reward_models import saved_reward_model

        saved_reward_model(reward_model_dir)
        open(saved, "w").close()
    deadline = time.monotonic() + 300  # a hang guard
    while not os.path.exists(saved) and time.monotonic() < deadline:
        time.sleep(0.1)

    def run(name: str, strategy: Any) -> None:
        scored: list[tuple[list, list]] = []

        def recorder(prompts: list, completions: list, **_: Any) -> list[float]:
            scored.append((list(prompts), list(completions)))
            return [0.0] * len(prompts)

        module = GRPOModule(
            build_model(),
            tokenizer=transformers.ByT5Tokenizer(),
            reward_funcs=[reward_model_dir, recorder],
            num_generations=4,
            steps_per_generation=1,
            max_completion_length=4,
            learning_rate=1e-2,
            scheduler="constant",
            generation_seed=0,
        )
        metrics: list[dict[str, float]] = []
        inner = module._score

        def score(batch: dict, completions: Any, *args: Any) -> Any:
            advantages, round_metrics = inner(batch, completions, *args)
            metrics.append({k: float(v) for k, v in round_metrics.items() if k.startswith(("reward", "rewards/"))})
            return advantages, round_metrics

        module._score = score
        dm = PromptDataModule(
            tokenizer=transformers.ByT5Tokenizer(),
            batch_size=4,
            max_length=16,
            val_size=0,
            sampling="sequential",
            dataset=Dataset.from_dict({"prompt": prompt_texts()[:4]}),
        )
        fit = L.Trainer(
            accelerator="cpu",
            strategy=strategy,
            devices=2,
            max_steps=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        fit.fit(module, datamodule=dm)
        device = str(module.reward_funcs[0].model.device)
        torch.save(
            {"scored": scored, "metrics": metrics, "device": device, "world_size": fit.world_size},
            os.path.join(out_dir, f"{name}_rank{fit.global_rank}.pt"),
        )

    run("ddp", "ddp")
    run("model_parallel", model_parallel(2))
