"""GRPO on 2 CPU ranks (gloo) resumes exactly under DDP and under FSDP2 (``ModelParallelStrategy``), in ONE launch
(Lightning's launcher re-executes this file for rank 1): asynchronous at ``max_staleness=1`` (DDP and FSDP2), and
synchronous from a checkpoint inside a round (FSDP2, ``steps_per_generation=2``: the buffered round is in it; GRPO
with its adaptive entropy bonus, and RLOO).

Usage: python ddp_grpo_async_resume.py OUT_DIR. Per case: an uninterrupted fit of ``STEPS`` optimizer steps, and a fit
that writes a checkpoint at its stop step (a file under DDP, a distributed checkpoint folder under FSDP2) followed by a
fresh module resumed from it to ``STEPS``. Asynchronous: each rank has its own rollout worker, and the checkpoint
carries the weights version the rounds in flight at the stop were sampled with (rank 0's copy, the same on every
rank). ``ModelParallelStrategy`` loads a checkpoint after ``on_fit_start`` (other strategies before it): the case that
found rollout state restored in ``on_fit_start`` alone, and so never under FSDP2. Writes from each rank ``rank{r}.pt``:
per case, the full trainable weights at the end of both runs and at the stop, and the ``async/staleness`` of every
logged step of both.
"""

import os
import sys

if __name__ == "__main__":
    import _fsdp_common as common
    import lightning as L
    import torch
    import transformers
    from datasets import Dataset, disable_progress_bars
    from lightning.pytorch.callbacks import ModelCheckpoint

    from helpers.models import tiny_llama
    from lit_trainer.data.prompt import PromptDataModule
    from lit_trainer.modules.grpo import GRPOModule
    from lit_trainer.modules.rloo import RLOOModule

    disable_progress_bars()
    out = sys.argv[1]
    torch.set_num_threads(1)
    STEPS = 4

    def token_sum(prompts, completions, completion_ids, **columns):
        """Differs within nearly every group: every round's advantages are non-zero."""
        return [float(sum(ids) % 7) for ids in completion_ids]

    class Staleness(L.Callback):
        def __init__(self) -> None:
            self.values = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            value = trainer.callback_metrics.get("async/staleness")
            if value is not None:
                self.values[trainer.global_step] = float(value)

    def run(strategy, steps, options, root=None, stop=None, ckpt_path=None):
        L.seed_everything(0)
        options = dict(options)
        module = options.pop("module_class", GRPOModule)(
            tiny_llama(0), tokenizer=transformers.ByT5Tokenizer(), reward_funcs=[token_sum], num_generations=4,
            max_completion_length=4, learning_rate=1e-2, scheduler="constant", max_grad_norm=0.0, generation_seed=0,
            **options,
        )  # fmt: skip
        data = PromptDataModule(
            tokenizer=transformers.ByT5Tokenizer(), max_length=16, val_size=0, sampling="sequential", batch_size=4,
            dataset=Dataset.from_dict({"prompt": [f"{10 + i}+11=" for i in range(32)]}),
        )  # fmt: skip
        staleness = Staleness()
        callbacks = [staleness]
        if root is not None:
            callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=stop, save_top_k=-1))
        trainer = common.trainer(
            strategy, 2, steps, callbacks, accumulate_grad_batches=1, log_every_n_steps=1,
            enable_checkpointing=root is not None,
        )  # fmt: skip
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
        weights = {n: w for n, w in common.full_weights(module).items() if n in trainable}
        return weights, staleness.values, trainer.global_rank

    asynchronous = {"max_staleness": 1, "rollout_worker_threads": 1}
    entropy = {"entropy_coef": 0.01, "use_adaptive_entropy": True, "entropy_target": 10.0, "entropy_coef_delta": 0.05}
    cases = (
        ("ddp", lambda: "ddp", asynchronous, 2),
        ("sharded", common.model_parallel, asynchronous, 2),
        # with GRPO's adaptive entropy bonus: its coefficient moves every step and is part of the checkpoint
        ("sharded_sync_mid_round", common.model_parallel, {"steps_per_generation": 2, **entropy}, 3),
        ("rloo_sharded_mid_round", common.model_parallel, {"steps_per_generation": 2, "module_class": RLOOModule}, 3),
    )
    results = {}
    for name, strategy, options, stop in cases:  # a fresh strategy per fit: one that has run a fit is not reused
        whole, whole_staleness, rank = run(strategy(), STEPS, options)
        root = os.path.join(out, name)
        at_stop, _, _ = run(strategy(), stop, options, root=root, stop=stop)
        checkpoint = os.path.join(root, f"epoch=0-step={stop}.ckpt")
        resumed, resumed_staleness, _ = run(strategy(), STEPS, options, ckpt_path=checkpoint)
        results[name] = {
            "whole": whole, "at_stop": at_stop, "resumed": resumed,
            "whole_staleness": whole_staleness, "resumed_staleness": resumed_staleness,
        }  # fmt: skip
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
