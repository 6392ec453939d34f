"""GRPO and RLOO sampled by vLLM on 2 CPU ranks (gloo), under DDP and under FSDP2 (``ModelParallelStrategy``), in ONE
launch.

Usage: python ddp_vllm.py OUT_DIR (``$LIT_TRAINER_VLLM_PYTHON`` names the vLLM environment's interpreter). Lightning's
launcher re-executes this file for rank 1. Each rank has its own vLLM server. GRPO samples through its rollout worker:
under FSDP2 the trainer gathers the weights one parameter at a time into the worker's shared memory, and the engine
reloads them into vLLM. RLOO samples in the training process: under FSDP2 (here with LoRA adapters, merged for vLLM)
every rank gathers the whole model one tensor at a time for its own server; on-policy distillation with a sharded
student does the same. Writes from each rank ``rank{r}.pt``: per case, the sampler check's gaps (every round, this
rank's largest; distillation has none: the engine's reload count), the initial and final full weights.
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
    from lit_trainer.data.sft import SFTDataModule
    from lit_trainer.models import load_tokenizer
    from lit_trainer.modules.distillation import DistillationModule
    from lit_trainer.modules.grpo import GRPOModule
    from lit_trainer.modules.rloo import RLOOModule

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

    grpo = {"max_staleness": 1, "rollout_worker_threads": 1}
    rloo = {"beta": 0.0}
    lora = {"peft_config": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}}
    cases = (
        ("ddp", GRPOModule, "ddp", grpo),
        ("sharded", GRPOModule, common.model_parallel(), grpo),
        ("rloo_ddp", RLOOModule, "ddp", rloo),
        ("rloo_sharded_lora", RLOOModule, common.model_parallel(), {**rloo, **lora}),
    )
    results = {}
    for name, cls, strategy, options in cases:
        L.seed_everything(0)
        model = tiny_llama(0, hidden=64, layers=2, heads=2, intermediate=128)
        module = cls(
            model, tokenizer=transformers.ByT5Tokenizer(), reward_funcs=[even_tokens], num_generations=4,
            max_completion_length=6, learning_rate=1e-2, scheduler="constant", max_grad_norm=0.0, generation_seed=0,
            rollout_engine="vllm", rollout_engine_options={"max_model_len": 64, "threads": 1}, **options,
        )  # fmt: skip
        initial = {n: p.detach().clone() for n, p in module.model.named_parameters()}
        data = PromptDataModule(
            tokenizer=transformers.ByT5Tokenizer(), max_length=16, val_size=0, sampling="sequential", batch_size=4,
            dataset=Dataset.from_dict({"prompt": [f"{10 + i}+11=" for i in range(16)]}),
        )  # fmt: skip
        gaps = Gaps()
        trainer = common.trainer(strategy, 2, 3, [gaps], accumulate_grad_batches=1, log_every_n_steps=1)
        trainer.fit(module, datamodule=data)
        results[name] = {"gaps": gaps.gaps, "initial": initial, "final": common.full_weights(module)}

    # on-policy distillation, the student sharded: vLLM in the training process, as RLOO
    tokenizer = load_tokenizer("tiny")
    L.seed_everything(0)
    module = DistillationModule(
        tiny_llama(0, hidden=64, layers=2, heads=2, intermediate=128), teacher_model=tiny_llama(1, hidden=32),
        tokenizer=tokenizer, lmbda=1.0, max_new_tokens=6, temperature=1.0, learning_rate=1e-2, generation_seed=0,
        rollout_engine="vllm", rollout_engine_options={"max_model_len": 64, "threads": 1},
    )  # fmt: skip
    initial = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    rows = {"prompt": [f"{10 + i}+11=" for i in range(16)], "completion": [str(21 + i) for i in range(16)]}
    data = SFTDataModule(
        tokenizer=tokenizer, dataset=Dataset.from_dict(rows), val_size=0, batch_size=2, max_length=16,
        sampling="sequential",
    )  # fmt: skip
    trainer = common.trainer(common.model_parallel(), 2, 3, [], accumulate_grad_batches=1)
    trainer.fit(module, datamodule=data)
    final = common.full_weights(module)
    results["distill_sharded"] = {"reloads": module.rollouts.engine.reloads, "initial": initial, "final": final}
    torch.save(results, os.path.join(out, f"rank{trainer.global_rank}.pt"))
