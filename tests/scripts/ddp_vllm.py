"""GRPO sampled by vLLM on 2 CPU ranks (gloo), under DDP and under FSDP2 (``ModelParallelStrategy``), in ONE launch.

Usage: python ddp_vllm.py OUT_DIR (``$LIT_TRAINER_VLLM_PYTHON`` names the vLLM environment's interpreter). Lightning's
launcher re-executes this file for rank 1. Each rank has its own rollout worker and its own vLLM server; under FSDP2
the trainer gathers the weights one parameter at a time into the worker's shared memory, and the engine reloads them
into vLLM. Writes from each rank ``rank{r}.pt``: per strategy, the sampler check's gaps (every round, this rank's
largest), the initial and final full weights.
"""

import os
import sys

if __name__ == "__main__":
    import _fsdp_common as common
    import lightning as L
    import torch
    import transformers
    from datasets import Dataset, disable_progress_bars

    from helpers.models import tiny_llama
    from lit_trainer.data.prompt import PromptDataModule
    from lit_trainer.modules.grpo import GRPOModule

    disable_progress_bars()
    out = sys.argv[1]
    torch.set_num_threads(1)

    def even_tokens(prompts, completions, completion_ids, **columns):
        return [float(sum(t % 2 == 0 for t in ids)) for ids in completion_ids]

    class Gaps(L.Callback):
        def __init__(self) -> None:
            self.gaps = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            value = trainer.callback_metrics.get("sampler_check/logp_gap_max")
            if value is not None:
                self.gaps.append(float(value))

    results = {}
    for name, strategy in (("ddp", "ddp"), ("sharded", common.model_parallel())):
        L.seed_everything(0)
        model = tiny_llama(0, hidden=64, layers=2, heads=2, intermediate=128)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        module = GRPOModule(
            model, tokenizer=transformers.ByT5Tokenizer(), reward_funcs=[even_tokens], num_generations=4,
            max_completion_length=6, learning_rate=1e-2, scheduler="constant", max_grad_norm=0.0, generation_seed=0,
            max_staleness=1, rollout_engine="vllm", rollout_worker_threads=1,
            rollout_engine_options={"max_model_len": 64, "threads": 1},
        )  # fmt: skip
        data = PromptDataModule(
            tokenizer=transformers.ByT5Tokenizer(), max_length=16, val_size=0, sampling="sequential", batch_size=4,
            dataset=Dataset.from_dict({"prompt": [f"{10 + i}+11=" for i in range(16)]}),
        )  # fmt: skip
        gaps = Gaps()
        trainer = common.trainer(strategy, 2, 3, [gaps], accumulate_grad_batches=1, log_every_n_steps=1)
        trainer.fit(module, datamodule=data)
        results[name] = {"gaps": gaps.gaps, "initial": initial, "final": common.full_weights(module)}
    torch.save(results, os.path.join(out, f"rank{trainer.global_rank}.pt"))
