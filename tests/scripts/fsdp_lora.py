"""LoRA over an FSDP2-sharded, frozen base (``ModelParallelStrategy``) on 2 CPU ranks (gloo), in ONE launch.

Usage: python fsdp_lora.py OUT_DIR. Lightning's launcher re-executes this file for rank 1. Runs, in order:

* SFT with LoRA, ``lora_common.SFT_STEPS`` steps, a distributed checkpoint after every step and ``HFExport`` (the
  adapter, gathered on rank 0); then the same fit resumed from the step-2 checkpoint; writes ``sft.pt`` (the gathered
  weights of both fits, the parameter types, the logits of the trained module on ``lora_common.PROBE``);
* DPO with LoRA (the reference is the policy with its adapters disabled, on every rank); writes ``dpo.pt``;
* GRPO with LoRA and ``beta > 0`` (adapter-disabled reference, generation on the sharded model), sharded, and under
  DDP in float32 and float64 (the calibration); writes ``grpo_rank{r}.pt`` from each rank.

Checked by ``tests/test_fsdp_lora.py`` against one-process runs (SFT, DPO) and the DDP run (GRPO).
"""

import os
import sys

if __name__ == "__main__":
    import _fsdp_common as common
    import lora_common
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_trainer.callbacks import HFExport

    out = sys.argv[1]
    torch.set_num_threads(1)

    module = lora_common.sft_module()
    checkpoints = ModelCheckpoint(
        dirpath=os.path.join(out, "sft_ckpt"), every_n_train_steps=1, save_top_k=-1, filename="{step}"
    )
    export = HFExport(os.path.join(out, "sft_export"))
    trainer = common.trainer(
        common.model_parallel(), 2, lora_common.SFT_STEPS, [checkpoints, export], enable_checkpointing=True
    )
    trainer.fit(module, datamodule=lora_common.sft_datamodule(2))
    weights = lora_common.adapter_weights(module)
    types = {type(p).__name__ for p in module.model.parameters()}  # before a forward leaves the root gathered
    logits = lora_common.probe_logits(module.model)  # a collective: every rank runs the sharded forward
    resumed = lora_common.sft_module()
    common.trainer(common.model_parallel(), 2, lora_common.SFT_STEPS, [], enable_checkpointing=False).fit(
        resumed, datamodule=lora_common.sft_datamodule(2), ckpt_path=os.path.join(out, "sft_ckpt", "step=2.ckpt")
    )
    resumed_weights = lora_common.adapter_weights(resumed)
    if trainer.is_global_zero:
        torch.save(
            {"weights": weights, "resumed": resumed_weights, "logits": logits, "param_types": types},
            os.path.join(out, "sft.pt"),
        )

    dpo = lora_common.dpo_module()
    common.trainer(common.model_parallel(), 2, lora_common.DPO_STEPS, []).fit(
        dpo, datamodule=common.dpo_datamodule(dpo.tokenizer, 2)
    )
    dpo_weights = lora_common.adapter_weights(dpo)
    if trainer.is_global_zero:
        torch.save({"weights": dpo_weights}, os.path.join(out, "dpo.pt"))

    grpo = {}
    for name, strategy, precision in (
        ("sharded", common.model_parallel(), "32-true"),
        ("ddp", "ddp", "32-true"),
        ("ddp64", "ddp", "64-true"),
    ):
        module, longest, initial = lora_common.grpo_run(strategy, precision)
        grpo[name] = {"weights": lora_common.adapter_weights(module), "initial": initial, "longest": longest}
    torch.save(grpo, os.path.join(out, f"grpo_rank{module.global_rank}.pt"))
