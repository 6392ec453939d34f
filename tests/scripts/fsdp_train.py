"""SFT, DPO, ORPO, KTO, GRPO and RLOO fits under ``ModelParallelStrategy`` (FSDP2) on 2 CPU ranks (gloo), in ONE launch.

Usage: python fsdp_train.py OUT_DIR. Lightning's launcher re-executes this file for rank 1. Writes, from rank 0:
``sft.pt``/``dpo.pt`` (final full weights, clipping norms, optimizer facts), ``sft_checkpointed.pt`` (the same SFT
with activation checkpointing and chunked logits), ``vision.pt`` (LoRA SFT of the ``tiny-vl``
vision-language model, ``ddp_vision.fsdp_run``), ``best.pt`` (BestCheckpoint(export_hf=True) over a distributed
checkpoint, with NEFTune), ``OUT_DIR/sft_export`` (HFExport), ``bema_best.pt`` (BEMA evaluated during fit,
BestCheckpoint(load_best_at_end=True), ``OUT_DIR/bema_export``); the DPO fit refreshes its sharded reference with
BEMA(update_ref_model=True);
from each rank ``grpo_rank{r}.pt`` (GRPO sharded, under DDP, under DDP in float64 (the calibration of the comparison),
and with asynchronous rollouts at ``max_staleness=0``, sharded and DDP; weights, longest completion per round,
clipping);
``orpo.pt`` (ORPO, reference-free: the sharded policy alone), ``kto.pt`` (KTO, policy and reference sharded); from
each rank ``rloo_rank{r}.pt`` (RLOO on GRPO's rollouts, sharded, DDP and DDP in float64).
Checked by ``tests/test_fsdp.py`` against single-process runs (SFT, DPO, ORPO, KTO) and the DDP runs (GRPO, RLOO).
"""

import os
import sys

if __name__ == "__main__":
    import _fsdp_common as common
    import torch
    from transformers import ByT5Tokenizer

    from helpers.models import tiny_llama
    from lit_trainer.callbacks import BestCheckpoint, HFExport, NEFTune
    from lit_trainer.modules.causal_lm import CausalLMModule

    out = sys.argv[1]
    torch.set_num_threads(1)
    tokenizer = ByT5Tokenizer()
    module = CausalLMModule(
        tiny_llama(seed=1, layers=2), tokenizer=tokenizer, learning_rate=1e-3, max_grad_norm=common.MAX_GRAD_NORM
    )
    clip = common.ClipRecorder()
    trainer = common.trainer(
        common.model_parallel(), 2, common.STEPS, [clip, HFExport(os.path.join(out, "sft_export"))]
    )
    trainer.fit(module, datamodule=common.sft_datamodule(tokenizer, 2))
    weights = common.full_weights(module)
    optimizer = trainer.optimizers[0]
    facts = {
        "weights": weights,
        "pre": clip.pre,
        "post": clip.post,
        "post64": clip.post64,
        "param_type": type(next(module.model.parameters())).__name__,
        "fused": optimizer.defaults.get("fused"),
        "foreach": optimizer.defaults.get("foreach"),
    }
    if trainer.is_global_zero:
        torch.save(facts, os.path.join(out, "sft.pt"))

    checkpointed = CausalLMModule(
        tiny_llama(seed=1, layers=2),
        tokenizer=tokenizer,
        learning_rate=1e-3,
        max_grad_norm=common.MAX_GRAD_NORM,
        gradient_checkpointing=True,
        chunked_logits="on",  # the head's weight gathered by FSDP2, swapped forward inside the sharded model
        logits_chunk_size=7,
    )
    common.trainer(common.model_parallel(), 2, common.STEPS, []).fit(
        checkpointed, datamodule=common.sft_datamodule(tokenizer, 2)
    )
    checkpointed_weights = common.full_weights(checkpointed)
    if trainer.is_global_zero:
        torch.save(checkpointed_weights, os.path.join(out, "sft_checkpointed.pt"))

    from ddp_vision import fsdp_run  # vision-language LoRA SFT on tiny-vl, micro-batches with and without images

    vision = fsdp_run(common.model_parallel(), 2, 2)
    if trainer.is_global_zero:
        torch.save(vision, os.path.join(out, "vision.pt"))

    best = BestCheckpoint(dirpath=os.path.join(out, "best_ckpt"), monitor="val_loss", export_hf=True)
    scored = CausalLMModule(tiny_llama(seed=3, layers=2), tokenizer=tokenizer, learning_rate=1e-3)
    neftune = NEFTune(noise_alpha=5.0, seed=7)  # on the sharded model's input embedding
    common.trainer(
        common.model_parallel(),
        2,
        1,
        [best, neftune],
        enable_checkpointing=True,
        limit_val_batches=None,
        val_check_interval=2,
        check_val_every_n_epoch=None,
    ).fit(scored, datamodule=common.sft_datamodule(tokenizer, 2, val_size=4))
    scored_weights = common.full_weights(scored)  # the only (so the best) checkpoint: after step 1
    if trainer.is_global_zero:
        torch.save(
            {
                "weights": scored_weights,
                "export": best.hf_export_dir,
                "checkpoint": best.best_model_path,
                "neftune_draws": neftune._draws,
            },
            os.path.join(out, "best.pt"),
        )

    dpo = common.dpo_module(tokenizer)
    trainer = common.trainer(common.model_parallel(), 2, common.DPO_STEPS, [common.dpo_bema()])
    trainer.fit(dpo, datamodule=common.dpo_datamodule(tokenizer, 2))
    dpo_facts = {
        "weights": common.full_weights(dpo),
        "ref": common.full_weights(dpo, "ref_model"),
        "ref_types": {type(p).__name__ for p in dpo.ref_model.parameters()},
    }
    if trainer.is_global_zero:
        torch.save(dpo_facts, os.path.join(out, "dpo.pt"))

    orpo = common.orpo_module(tokenizer)  # reference-free: only the policy is sharded
    trainer = common.trainer(common.model_parallel(), 2, common.DPO_STEPS, [])
    trainer.fit(orpo, datamodule=common.dpo_datamodule(tokenizer, 2))
    orpo_weights = common.full_weights(orpo)
    if trainer.is_global_zero:
        torch.save({"weights": orpo_weights}, os.path.join(out, "orpo.pt"))

    kto = common.kto_module(tokenizer)  # the policy and the frozen reference both sharded
    trainer = common.trainer(common.model_parallel(), 2, common.DPO_STEPS, [])
    trainer.fit(kto, datamodule=common.kto_datamodule(tokenizer, 2))
    kto_facts = {
        "weights": common.full_weights(kto),
        "ref_types": {type(p).__name__ for p in kto.ref_model.parameters()},
    }
    if trainer.is_global_zero:
        torch.save(kto_facts, os.path.join(out, "kto.pt"))

    bema_best = common.bema_best_run(common.model_parallel, 2, 2, out)
    if trainer.is_global_zero:
        torch.save(bema_best, os.path.join(out, "bema_best.pt"))

    grpo = {}
    runs = (("sharded", common.model_parallel(), "32-true"), ("ddp", "ddp", "32-true"), ("ddp64", "ddp", "64-true"))
    for name, strategy, precision in runs:
        module, longest, clip, initial = common.grpo_run(strategy, precision)
        weights = common.full_weights(module)
        grpo[name] = {"weights": weights, "initial": initial, "longest": longest, "pre": clip.pre, "post": clip.post}
        grpo[name]["ref"] = common.full_weights(module, "ref_model")
        grpo[name]["post64"] = clip.post64
    # asynchronous rollouts at max_staleness=0, one worker per rank: on the shards (each worker holds a whole copy,
    # sent one gathered parameter at a time) and under DDP
    for name, strategy in (("sharded_async", common.model_parallel()), ("ddp_async", "ddp")):
        module, longest, _, _ = common.grpo_run(strategy, "32-true", max_staleness=0)
        grpo[name] = {
            "weights": common.full_weights(module),
            "longest": longest,
            "worker": module.async_rollouts.worker,
        }
    torch.save(grpo, os.path.join(out, f"grpo_rank{module.global_rank}.pt"))

    rloo = {}  # RLOO on the same rollouts: its KL-in-the-reward needs the sharded reference's log-probs
    runs = (("sharded", common.model_parallel(), "32-true"), ("ddp", "ddp", "32-true"), ("ddp64", "ddp", "64-true"))
    for name, strategy, precision in runs:  # a fresh strategy: one that has run a fit is not reused
        module, longest, _, initial = common.grpo_run(strategy, precision, module_class="RLOOModule")
        rloo[name] = {"weights": common.full_weights(module), "initial": initial, "longest": longest}
    torch.save(rloo, os.path.join(out, f"rloo_rank{module.global_rank}.pt"))
