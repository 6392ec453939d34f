"""QLoRA vs TRL: one SFT step of CausalLMModule and of TRL 1.16's SFTTrainer on the same 4-bit model and batch.

Set-up, the same on both sides: a seeded ``tiny`` preset and its tokenizer saved to a temporary folder and loaded from
it quantized (NF4, double quantization, float32 compute dtype: lit_trainer's ``quantization=`` mapping and TRL's
``quantization_config=``); LoRA r=``--rank``, alpha=2r, all linear layers, no dropout; every adapter weight then set
to the same float32 values drawn from one seeded generator (lora_A uniform in +-1/sqrt(fan_in) as peft draws it,
lora_B normal with std 0.02 instead of zeros, so lora_A gets gradients too). The first ``--rows`` built-in addition
rows (prompt/completion: loss on the completion and EOS) are tokenized by each side's own pipeline (TRL's dataset
preparation and collator, SFTDataModule); the script checks that token ids, attention masks, labels and target counts
are equal, and that the frozen quantized bases (packed 4-bit weights, quantization constants, norms, embeddings) are
bitwise equal. TRL: the first batch of ``get_train_dataloader()`` (sequential sampling) and its token count from
``get_batch_samples``, through ``training_step`` (SFTTrainer.compute_loss + backward). lit_trainer: ``compute_loss``
+ backward. SFTConfig(bf16=False, gradient_checkpointing=False): float32 compute on both sides, as the quantization.

A known difference: TRL 1.16 casts the trainable weights of a quantized model to bfloat16 (SFTTrainer.__init__, after
``get_peft_model``, under ``_is_quantized_model``); lit_trainer keeps the adapters float32. Rows:
  * ``matched``: our adapters cast to bfloat16 the same way vs TRL (expected: float rounding);
  * ``default``: our float32 adapters vs TRL (the difference is the bf16 cast);
  * ``bf16 cast, ours alone``: our bfloat16 vs our float32 adapters (the cast's effect without TRL);
  * ``calibration fp32`` / ``calibration bf16``: our own gradient (float32 / bfloat16 adapters) as one micro-batch of
    all rows vs two micro-batches of half the rows summed (``num_items_in_batch`` = the batch's target tokens): how
    far a change of reduction order alone moves the same computation.
Columns: loss of each side, |loss difference|, relative L2 difference of the adapter gradients
||g_a - g_b|| / ||g_b|| over all adapter weights concatenated, and the largest of it over single adapter tensors.
CPU only (the model is tiny: the whole run takes seconds, mostly imports and loading).

Usage: python benchmarks/qlora_trl.py [--rows 8] [--rank 16] [--seed 0] [--threads 2]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import warnings

import datasets
import torch
from peft import LoraConfig
from transformers import BitsAndBytesConfig
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
        max_length=32,
        report_to=[],
        save_strategy="no",
        bf16=False,  # SFTConfig's default True would autocast the forward to bfloat16
        gradient_checkpointing=False,  # SFTConfig's default True; lit_trainer's default is False
        train_sampling_strategy="sequential",  # the batch's rows in dataset order, as SFTDataModule's
        use_cpu=True,
        dataloader_num_workers=0,
        seed=args.seed,
    )
    return SFTTrainer(
        model=folder,
        args=config,
        train_dataset=rows,
        processing_class=load_tokenizer(folder),
        peft_config=LoraConfig(**lora),
        quantization_config=BitsAndBytesConfig(**bnb),
    )


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
    equal = sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa
    )  # fmt: skip
    return equal, len(sa)


def take_grads(model: torch.nn.Module) -> Grads:
    return {name: p.grad.detach().float().clone() for name, p in adapters(model).items()}


def trl_step(trainer: SFTTrainer) -> tuple[dict, torch.Tensor, float, Grads]:
    """TRL's first batch, its token count, and the loss + adapter gradients of one ``training_step``."""
    samples, num_items = trainer.get_batch_samples(iter(trainer.get_train_dataloader()), 1, trainer.args.device)
    batch = {k: v.clone() for k, v in samples[0].items()}  # training_step may edit its inputs
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.training_step(trainer.model, samples[0], num_items)
    return batch, num_items, float(loss), take_grads(trainer.model)


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


def relative_l2(a: Grads, b: Grads) -> tuple[float, float]:
    """``(||a - b|| / ||b|| over all tensors concatenated, the largest per-tensor value)`` in float64."""
    diff = sum(float((a[k].double() - b[k].double()).square().sum()) for k in b)
    norm = sum(float(b[k].double().square().sum()) for k in b)
    worst = max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm()) for k in b)
    return math.sqrt(diff / norm), worst


def show_batch(batch: dict, num_items: torch.Tensor, tokenizer) -> None:  # noqa: ANN001
    print(f"batch ({batch['input_ids'].shape[0]} rows x {batch['input_ids'].shape[1]} tokens, right-padded; "
          f"{int(num_items)} target tokens = labels[:, 1:] != -100):")  # fmt: skip
    for ids, mask, labels in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
        text = tokenizer.decode(ids[mask.bool()])
        targets = tokenizer.decode(labels[labels != IGNORE_INDEX])
        print(f"  {text!r:22} ids={ids.tolist()}  loss on {targets!r}")


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
        data = SFTDataModule(
            tokenizer=module.tokenizer, dataset=rows, val_size=0, batch_size=args.rows, max_length=32,
            sampling="sequential",
        )  # fmt: skip
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

        fp32_loss, fp32_grads = our_step(module, batch, 1)
        fp32_split_loss, fp32_split_grads = our_step(module, batch, 2)
        cast_adapters_to_bf16(module.model)
        bf16_loss, bf16_grads = our_step(module, batch, 1)
        bf16_split_loss, bf16_split_grads = our_step(module, batch, 2)

    print(f"command: python benchmarks/{' '.join(sys.argv)}".replace("benchmarks/benchmarks/", "benchmarks/"))
    trainable = sum(p.numel() for p in adapters(module.model).values())
    print(
        f"model: preset 'tiny' (seed {args.seed}) quantized NF4 + double quantization, float32 compute; LoRA r={args.rank}"
        f" alpha={2 * args.rank} on all linear layers ({len(names)} adapter tensors, {trainable:,} weights); "
        f"{args.threads} thread(s), CPU"
    )
    print(f"adapter dtype after construction: TRL {', '.join(trl_dtypes)}; lit_trainer {', '.join(our_dtypes)}")
    print(f"frozen quantized base identical on both sides: {base_equal} ({base_tensors} tensors compared bitwise)")
    show_batch(batch, trl_items, module.tokenizer)
    print("input_ids, attention_mask, labels and target count equal on both sides: " + ", ".join(same))
    print()
    header = "| comparison | loss a | loss b | abs loss diff | grad rel L2 (all adapters) | worst tensor rel L2 |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for label, (la, ga), (lb, gb) in (
        ("matched: lit_trainer bf16 adapters (a) vs TRL (b)", (bf16_loss, bf16_grads), (trl_loss, trl_grads)),
        ("default: lit_trainer fp32 adapters (a) vs TRL (b)", (fp32_loss, fp32_grads), (trl_loss, trl_grads)),
        ("bf16 cast, ours alone: bf16 (a) vs fp32 (b) adapters", (bf16_loss, bf16_grads), (fp32_loss, fp32_grads)),
        (
            f"calibration fp32: ours 2x{args.rows // 2} rows (a) vs 1x{args.rows} (b)",
            (fp32_split_loss, fp32_split_grads),
            (fp32_loss, fp32_grads),
        ),
        (
            f"calibration bf16: ours 2x{args.rows // 2} rows (a) vs 1x{args.rows} (b)",
            (bf16_split_loss, bf16_split_grads),
            (bf16_loss, bf16_grads),
        ),
    ):
        total, worst = relative_l2(ga, gb)
        print(f"| {label} | {la:.7f} | {lb:.7f} | {abs(la - lb):.2e} | {total:.2e} | {worst:.2e} |")
    print(f"wall time: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
