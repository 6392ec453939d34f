"""QLoRA vs TRL: one SFT step of CausalLMModule and of TRL 1.16's SFTTrainer on the same 4-bit model and batch.

Set-up, the same on both sides: a seeded ``tiny`` preset and its tokenizer saved to a temporary folder and loaded from
it quantized (NF4, double quantization, float32 compute dtype: lit_trainer's ``quantization=`` mapping and TRL's
``quantization_config=``); LoRA r=``--rank``, alpha=2r, all linear layers, no dropout; every adapter weight then set
to the same float32 values drawn from one seeded generator (lora_A uniform in +-1/sqrt(fan_in) as peft draws it,
lora_B normal with std 0.02 instead of peft's zeros, so lora_A gets gradients too). The first ``--rows`` built-in
addition rows (prompt/completion: loss on the completion and EOS) are tokenized by each side's own pipeline (TRL's
dataset preparation and collator, SFTDataModule); the script checks that token ids, attention masks, labels and target
counts are equal, and that the frozen quantized bases (packed 4-bit weights, quantization state, norms, embeddings)
are bitwise equal. TRL: the first batch of ``get_train_dataloader()`` (sequential sampling) and its target count from
``get_batch_samples``, through ``training_step`` (SFTTrainer.compute_loss + backward); then a real
``trainer.train()`` of one step, its gradient captured before the optimizer step. lit_trainer: ``compute_loss`` +
backward. SFTConfig(bf16=False, gradient_checkpointing=False, max_grad_norm=0): float32 compute on both sides as the
quantization asks, no recomputation, the raw gradient.

A known difference: TRL 1.16 casts the trainable weights of a quantized model to bfloat16 (SFTTrainer.__init__, after
``get_peft_model``, under ``_is_quantized_model``); lit_trainer keeps the adapters float32. Rows of the table:
  * ``matched``: our adapters cast to bfloat16 the same way vs TRL (expected: float rounding);
  * ``default``: our float32 adapters vs TRL (the difference is the bf16 cast);
  * ``bf16 cast, ours alone``: our bfloat16 vs our float32 adapters (the cast's effect without TRL);
  * ``calibration fp32`` / ``calibration bf16``: our own gradient (float32 / bfloat16 adapters) as one micro-batch of
    all rows vs two micro-batches of half the rows summed (``num_items_in_batch`` = the batch's target tokens): how
    far a change of reduction order alone moves the same computation (compare ``matched`` with the bf16 one);
  * ``TRL train()``: the step of ``trainer.train()`` vs ``training_step`` called directly (checks the harness).
Columns: loss of each side, |loss difference|, relative L2 difference of the adapter gradients
||g_a - g_b|| / ||g_b|| over all adapter weights concatenated, and the largest of it over single adapter tensors.
After the table, what the cast does to an optimizer step: the share of lora_A / lora_B entries that one fused AdamW
step at ``--lr`` (weight decay 0) changes, for TRL's ``train()`` and for our adapters in float32 and in bfloat16
(Adam's first step moves every weight by about lr; in bfloat16 a step under half a unit in the last place is lost).
CPU only: the model is tiny, the run takes seconds, most of them imports and loading.

Usage: python benchmarks/qlora_trl.py [--rows 8] [--rank 16] [--lr 2e-5] [--seed 0] [--threads 2]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import warnings
from typing import Any

import datasets
import torch
from peft import LoraConfig
from transformers import BitsAndBytesConfig, TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.utils import logging as hf_logging
from trl import SFTConfig, SFTTrainer

from lit_trainer.data import builtin
from lit_trainer.data.sft import SFTDataModule
from lit_trainer.losses.logprobs import IGNORE_INDEX
from lit_trainer.models import load_model, load_tokenizer
from lit_trainer.modules.causal_lm import CausalLMModule

BATCH_KEYS = ("input_ids", "attention_mask", "labels")
Grads = dict[str, torch.Tensor]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="rows of the one batch (even: the calibration halves it)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA r (lora_alpha = 2r)")
    parser.add_argument("--lr", type=float, default=2e-5, help="AdamW step size (SFTConfig's and our default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the preset's weights and of the adapter values")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.rows < 2 or args.rows % 2:
        parser.error("--rows must be even and >= 2 (the calibration splits the batch in two halves)")
    return args


def quiet() -> None:
    """No progress bars or deprecation chatter from transformers, datasets and TRL (the table is the output)."""
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


def trl_trainer(folder: str, rows: datasets.Dataset, bnb: dict, lora: dict, args: argparse.Namespace) -> SFTTrainer:
    config = SFTConfig(
        output_dir=f"{folder}/trl",
        max_steps=1,
        per_device_train_batch_size=args.rows,
        learning_rate=args.lr,
        max_length=32,
        report_to=[],
        save_strategy="no",
        bf16=False,  # SFTConfig's default True: the prepared model's forward would autocast to bfloat16
        gradient_checkpointing=False,  # SFTConfig's default True; lit_trainer's default is False
        max_grad_norm=0.0,  # the captured train() gradient unclipped (Adam's first step does not see the scale)
        train_sampling_strategy="sequential",  # the batch's rows in dataset order, as SFTDataModule's
        use_cpu=True,
        dataloader_num_workers=0,
        seed=args.seed,
    )
    trainer = SFTTrainer(
        model=folder,
        args=config,
        train_dataset=rows,
        processing_class=load_tokenizer(folder),
        peft_config=LoraConfig(**lora),
        quantization_config=BitsAndBytesConfig(**bnb),
    )
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    return trainer


def adapters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The trainable (adapter) parameters of a peft model, by name."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def set_adapter_values(model: torch.nn.Module, seed: int) -> None:
    """Every adapter weight from one seeded generator, in name order, drawn in float32 and copied into the weight
    (rounded to its dtype: bfloat16 on TRL's side)."""
    generator = torch.Generator().manual_seed(seed)
    for name, p in sorted(adapters(model).items()):
        if ".lora_A." in name:  # peft's kaiming_uniform(a=sqrt(5)) bound: 1/sqrt(fan_in)
            values = (torch.rand(p.shape, generator=generator) * 2 - 1) / math.sqrt(p.shape[1])
        else:  # lora_B: non-zero, so lora_A's gradient is not zero
            values = torch.randn(p.shape, generator=generator) * 0.02
        p.copy_(values)


def cast_adapters_to_bf16(model: torch.nn.Module) -> None:
    """What TRL 1.16's SFTTrainer does to a quantized model's trainable weights (DoRA magnitudes excepted)."""
    for name, p in adapters(model).items():
        if "lora_magnitude_vector" not in name:
            p.data = p.data.to(torch.bfloat16)


def frozen_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "lora_" not in k and torch.is_tensor(v)}


def same_frozen_base(a: torch.nn.Module, b: torch.nn.Module) -> tuple[bool, int]:
    """Whether the two peft models' frozen tensors (4-bit packed weights and quantization state included) are equal."""
    sa, sb = frozen_state(a), frozen_state(b)
    equal = sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)
    return equal, len(sa)


def take_grads(model: torch.nn.Module) -> Grads:
    return {name: p.grad.detach().float().clone() for name, p in adapters(model).items()}


def trl_step(trainer: SFTTrainer) -> tuple[dict, torch.Tensor, float, Grads]:
    """TRL's first batch, its target count, and the loss + adapter gradients of one ``training_step``."""
    samples, num_items = trainer.get_batch_samples(iter(trainer.get_train_dataloader()), 1, trainer.args.device)
    batch = {k: v.clone() for k, v in samples[0].items()}  # training_step may edit its inputs
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.training_step(trainer.model, samples[0], num_items)
    return batch, num_items, float(loss), take_grads(trainer.model)


def changed_shares(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Share of the lora_A and of the lora_B entries that differ between ``before`` and ``after``."""
    shares = []
    for part in (".lora_A.", ".lora_B."):
        keys = [k for k in before if part in k]
        changed = sum(int((after[k] != before[k]).sum()) for k in keys)
        shares.append(changed / sum(before[k].numel() for k in keys))
    return shares[0], shares[1]


def trl_train_step(trainer: SFTTrainer) -> tuple[float, Grads, tuple[float, float]]:
    """One real ``trainer.train()`` step: its loss, its adapter gradients just before the optimizer step, and the
    share of lora_A / lora_B entries the step changed."""
    before = {k: v.detach().clone() for k, v in adapters(trainer.model).items()}
    grads: Grads = {}

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            grads.update(take_grads(trainer.model))

    trainer.add_callback(Capture())
    trainer.model.zero_grad(set_to_none=True)
    output = trainer.train()
    return output.training_loss, grads, changed_shares(before, adapters(trainer.model))


def our_step(module: CausalLMModule, batch: dict, parts: int) -> tuple[float, Grads]:
    """Loss and adapter gradients of ``compute_loss`` + backward on ``batch``: one micro-batch (token mean,
    ``num_items_in_batch=None``), or ``parts`` row slices each normalised by the whole batch's target count."""
    module.model.zero_grad(set_to_none=True)
    count = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    size = batch["input_ids"].shape[0] // parts
    total = 0.0
    for start in range(0, batch["input_ids"].shape[0], size):
        part = {k: batch[k][start : start + size] for k in BATCH_KEYS}
        loss, _ = module.compute_loss(part, count if parts > 1 else None)
        loss.backward()
        total += float(loss)
    return total, take_grads(module.model)


def adamw_step_shares(module: CausalLMModule, grads: Grads, lr: float) -> tuple[float, float]:
    """Share of lora_A / lora_B entries one fused AdamW step (lit_trainer's default optimizer, weight decay 0) changes,
    on copies of the module's adapters (in their dtype) with ``grads``."""
    before = {k: p.detach().clone() for k, p in adapters(module.model).items()}
    copies = {k: v.clone().requires_grad_(True) for k, v in before.items()}
    for k, p in copies.items():
        p.grad = grads[k].to(p.dtype)
    torch.optim.AdamW(list(copies.values()), lr=lr, weight_decay=0.0, fused=True).step()
    return changed_shares(before, {k: p.detach() for k, p in copies.items()})


def relative_l2(a: Grads, b: Grads) -> tuple[float, float]:
    """``(||a - b|| / ||b|| over all tensors concatenated, the largest per-tensor value)`` in float64."""
    diff = sum(float((a[k].double() - b[k].double()).square().sum()) for k in b)
    norm = sum(float(b[k].double().square().sum()) for k in b)
    worst = max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm()) for k in b)
    return math.sqrt(diff / norm), worst


def show_batch(batch: dict, num_items: torch.Tensor, tokenizer: Any) -> None:
    rows, width = batch["input_ids"].shape
    print(f"batch: {rows} rows x {width} tokens, right-padded; {int(num_items)} target tokens (labels[:, 1:] != -100)")
    for ids, mask, labels in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
        text = tokenizer.decode(ids[mask.bool()])
        targets = tokenizer.decode(labels[labels != IGNORE_INDEX])
        print(f"  {text!r:18} ids={ids.tolist()}  loss on {targets!r}")


def main() -> None:
    start = time.perf_counter()
    args = parse()
    torch.set_num_threads(args.threads)
    quiet()
    bnb = {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": torch.float32,
    }
    lora = {"r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": "all-linear", "lora_dropout": 0.0}
    rows = builtin.sft_rows("train").select(range(args.rows)).select_columns(["prompt", "completion"])
    with tempfile.TemporaryDirectory(prefix="qlora_trl_") as folder:
        torch.manual_seed(args.seed)
        load_model("tiny").save_pretrained(folder)
        load_tokenizer("tiny").save_pretrained(folder)

        trainer = trl_trainer(folder, rows, bnb, lora, args)
        module = CausalLMModule(folder, quantization=bnb, peft_config={**lora, "task_type": "CAUSAL_LM"})
        options = {"val_size": 0, "batch_size": args.rows, "max_length": 32, "sampling": "sequential"}
        data = SFTDataModule(tokenizer=module.tokenizer, dataset=rows, **options)
        data.setup("fit")
        ours_batch = next(iter(data.train_dataloader()))

        names = sorted(adapters(trainer.model))
        if names != sorted(adapters(module.model)):
            raise SystemExit("the two sides wrap different layers with adapters")
        trl_dtypes = sorted({str(p.dtype) for p in adapters(trainer.model).values()})
        our_dtypes = sorted({str(p.dtype) for p in adapters(module.model).values()})
        base_equal, base_tensors = same_frozen_base(trainer.model, module.model)
        set_adapter_values(trainer.model, args.seed)
        set_adapter_values(module.model, args.seed)

        trl_batch, trl_items, trl_loss, trl_grads = trl_step(trainer)
        same = {k: torch.equal(trl_batch[k], ours_batch[k]) for k in BATCH_KEYS}
        same["target count"] = int(trl_items) == int(ours_batch["num_items_in_batch"])
        if not all(same.values()):
            raise SystemExit(f"the two sides' batches differ: {same}")
        batch = {k: ours_batch[k] for k in BATCH_KEYS}
        train_loss, train_grads, trl_shares = trl_train_step(trainer)

        fp32_loss, fp32_grads = our_step(module, batch, 1)
        fp32_split_loss, fp32_split_grads = our_step(module, batch, 2)
        fp32_shares = adamw_step_shares(module, fp32_grads, args.lr)
        cast_adapters_to_bf16(module.model)
        bf16_loss, bf16_grads = our_step(module, batch, 1)
        bf16_split_loss, bf16_split_grads = our_step(module, batch, 2)
        bf16_shares = adamw_step_shares(module, bf16_grads, args.lr)

    print(f"command: python benchmarks/{' '.join(sys.argv)}".replace("benchmarks/benchmarks/", "benchmarks/"))
    trainable = sum(p.numel() for p in adapters(module.model).values())
    print(
        f"model: preset 'tiny' (seed {args.seed}), 4-bit NF4 + double quantization, float32 compute dtype; "
        f"LoRA r={args.rank} alpha={2 * args.rank} on all linear layers ({len(names)} adapter tensors, "
        f"{trainable:,} weights); {args.threads} thread(s), CPU"
    )
    print(f"adapter dtype as built: TRL SFTTrainer {', '.join(trl_dtypes)}; lit_trainer {', '.join(our_dtypes)}")
    print(f"frozen quantized base bitwise equal on both sides: {base_equal} ({base_tensors} tensors)")
    show_batch(batch, trl_items, module.tokenizer)
    print(f"equal on both sides: {', '.join(same)}")
    print()
    half = args.rows // 2
    comparisons = (
        ("matched: lit_trainer bf16 adapters (a) vs TRL (b)", (bf16_loss, bf16_grads), (trl_loss, trl_grads)),
        ("default: lit_trainer fp32 adapters (a) vs TRL (b)", (fp32_loss, fp32_grads), (trl_loss, trl_grads)),
        ("bf16 cast, ours alone: bf16 (a) vs fp32 (b)", (bf16_loss, bf16_grads), (fp32_loss, fp32_grads)),
        (f"calibration fp32: ours 2x{half} (a) vs 1x{args.rows} rows (b)", (fp32_split_loss, fp32_split_grads),
         (fp32_loss, fp32_grads)),
        (f"calibration bf16: ours 2x{half} (a) vs 1x{args.rows} rows (b)", (bf16_split_loss, bf16_split_grads),
         (bf16_loss, bf16_grads)),
        ("TRL train() step (a) vs training_step (b)", (train_loss, train_grads), (trl_loss, trl_grads)),
    )  # fmt: skip
    header = "| comparison | loss a | loss b | abs loss diff | grad rel L2 (all adapters) | worst tensor rel L2 |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for label, (loss_a, grads_a), (loss_b, grads_b) in comparisons:
        total, worst = relative_l2(grads_a, grads_b)
        print(f"| {label} | {loss_a:.7f} | {loss_b:.7f} | {abs(loss_a - loss_b):.2e} | {total:.2e} | {worst:.2e} |")
    print()
    print(f"entries changed by one AdamW step (lr {args.lr:g}, weight decay 0), lora_A / lora_B:")
    for label, (share_a, share_b) in (
        ("TRL trainer.train() (bf16 adapters)", trl_shares),
        ("lit_trainer float32 adapters", fp32_shares),
        ("lit_trainer adapters cast to bf16", bf16_shares),
    ):
        print(f"  {label:36} {share_a:6.1%} / {share_b:6.1%}")
    print(f"wall time after imports: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
