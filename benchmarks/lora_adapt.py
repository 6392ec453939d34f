"""What LoRA is for, measured: ``configs/sft_lora.yaml`` adapts the main job's trained addition model to subtraction
(``builtin:subtraction``) while the base weights stay bit-identical.

In one process, after the main job (``lit-trainer fit --config configs/sft.yaml``) wrote its export:

1. the base: greedy exact match on the 500 held-out problems of addition and of subtraction, and the SHA-256 of its
   ``model.safetensors``;
2. the LoRA recipe through the ``lit-trainer`` command line (``LitTrainerCLI``, ``fit``) with ``model`` = the base;
3. the adapted module: exact match on subtraction and addition with the adapter on, and with the adapter disabled
   (``PeftModel.disable_adapter()``: the base network as it is now in memory);
4. the base weights: every frozen parameter of the trained module against the base file (``torch.equal``), the
   file's SHA-256 again, and which parameters changed (only ``lora_`` ones may);
5. the run's outputs: ``last.ckpt`` holds only adapter tensors (count and size vs the base file); the merged
   ``hf_model`` loads with ``from_pretrained`` and is scored on both tasks.

With a QLoRA recipe (``--config configs/sft_qlora.yaml``: ``quantization`` set) step 4 compares the packed 4-bit base
with the base file quantized afresh, and two more rows show where the adapter can go: merged into the dequantized
4-bit weights (the export) and merged into the unquantized base file (``PeftModel`` on the float base, then
``merge_and_unload``), each with its logit gap to the QLoRA model (relative L2 over 64 held-out prompts).

Usage: python benchmarks/lora_adapt.py [--base runs/sft/version_0/hf_model] [--config configs/sft_lora.yaml]
                                       [--threads 1] [-- extra lit-trainer arguments, e.g. --trainer.max_steps 500]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from safetensors.torch import load_file

from lit_trainer import CausalLMModule
from lit_trainer.cli import LitTrainerCLI
from lit_trainer.data import SFTDataModule
from lit_trainer.models import load_model, load_tokenizer

TASKS = ("builtin:addition", "builtin:subtraction")


def parse() -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="runs/sft/version_0/hf_model", help="the main job's export")
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "sft_lora.yaml"))
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv), extra


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def scores(network: Any, tokenizer: str) -> dict[str, float]:
    """Greedy exact match of ``network`` (a path or a model) on the 500 held-out problems of each task."""
    module = CausalLMModule(network, tokenizer=load_tokenizer(tokenizer), eval_exact_match=True, eval_max_new_tokens=5)
    out = {}
    for task in TASKS:
        data = SFTDataModule(tokenizer=tokenizer, dataset=task, max_length=32, batch_size=64, eval_batch_size=250)
        trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
        out[task.split(":")[1]] = trainer.validate(module, data, verbose=False)[0]["val_exact_match"]
    return out


def base_parameters(module: CausalLMModule) -> dict[str, torch.Tensor]:
    """The frozen base weights of a peft-wrapped module, under the names of the base's own state dict."""
    network = module.model.get_base_model()
    return {n.replace(".base_layer", ""): p for n, p in network.named_parameters() if "lora_" not in n}


def quantized_base(base_dir: str, module: CausalLMModule) -> dict[str, torch.Tensor]:
    """The base file quantized afresh as the run quantized it: its packed parameters, by name."""
    fresh = load_model(base_dir, quantization=module.hparams.quantization)
    return {n: p.detach() for n, p in fresh.named_parameters()}


def merged_into_float_base(module: CausalLMModule, base_dir: str) -> Any:
    """The trained adapter merged into the unquantized base file (not the weights it was trained on)."""
    import peft

    name = module.model.active_adapter
    config = copy.deepcopy(module.model.peft_config[name])
    wrapped = peft.get_peft_model(load_model(base_dir), config)
    peft.set_peft_model_state_dict(wrapped, peft.get_peft_model_state_dict(module.model, adapter_name=name))
    return wrapped.merge_and_unload().eval()


@torch.no_grad()
def logit_gaps(module: CausalLMModule, others: dict[str, Any], tokenizer: str) -> dict[str, float]:
    """Relative L2 gap of each model's logits to the QLoRA module's on 64 held-out subtraction prompts."""
    from transformers import AutoModelForCausalLM

    data = SFTDataModule(tokenizer=tokenizer, dataset=TASKS[1], max_length=32, batch_size=64, eval_batch_size=64)
    data.setup("validate")
    ids = next(iter(data.val_dataloader()))["input_ids"]
    module.model.eval()
    reference = module.model(input_ids=ids).logits
    gaps = {}
    for name, other in others.items():
        model = AutoModelForCausalLM.from_pretrained(other).eval() if isinstance(other, str) else other
        gaps[name] = float((model(input_ids=ids).logits - reference).norm() / reference.norm())
    return gaps


def main() -> None:
    args, extra = parse()
    torch.set_num_threads(args.threads)
    base_dir = Path(args.base)
    base_file = base_dir / "model.safetensors"
    if not base_file.exists():
        sys.exit(f"No export at {base_dir}: run the main job first (lit-trainer fit --config configs/sft.yaml).")
    digest_before = sha256(base_file)
    report: dict[str, Any] = {"base": scores(str(base_dir), str(base_dir))}

    started = time.perf_counter()
    cli = LitTrainerCLI(args=["fit", "--config", args.config, "--model.init_args.model", str(base_dir), *extra])
    report["train_s"] = time.perf_counter() - started
    module, run_dir = cli.model, Path(cli.trainer.log_dir)
    report["adapter on"] = scores(module.model, str(base_dir))
    with module.model.disable_adapter():
        report["adapter disabled"] = scores(module.model, str(base_dir))

    quantized = module.is_quantized
    saved = load_file(str(base_file)) if not quantized else quantized_base(str(base_dir), module)
    live = base_parameters(module)
    changed = [n for n, p in live.items() if not torch.equal(p.detach().cpu(), saved[n])]
    adapters = {n: p for n, p in module.named_parameters() if "lora_" in n}
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    state = checkpoint["state_dict"]
    report["merged export"] = scores(str(run_dir / "hf_model"), str(base_dir))
    if quantized:
        on_float = merged_into_float_base(module, str(base_dir))
        report["merged into the float base"] = scores(on_float, str(base_dir))
        gaps = logit_gaps(module, {"merged export": str(run_dir / "hf_model"), "float base": on_float}, str(base_dir))

    print(
        f"\nbase: {base_dir}\nLoRA run: {run_dir} ({report['train_s']:.0f} s of fit, {cli.trainer.global_step} steps)"
    )
    print("\n| model | addition exact match | subtraction exact match |\n|---|---|---|")
    for name in ("base", "adapter on", "adapter disabled", "merged export", "merged into the float base"):
        if name in report:
            print(f"| {name} | {report[name]['addition']:.3f} | {report[name]['subtraction']:.3f} |")
    if quantized:
        print(
            f"\nlogit gap to the QLoRA model (relative L2): merged export {gaps['merged export']:.2e}, adapter merged "
            f"into the unquantized base {gaps['float base']:.2e}"
        )
    print(
        f"\nbase parameters: {len(live)} tensors, {sum(p.numel() for p in live.values()):,} values; "
        f"bit-identical to the base file after training: {not changed and live.keys() == saved.keys()}"
        f" (changed: {changed or 'none'})"
    )
    print(f"base file SHA-256 before/after: {digest_before[:16]} / {sha256(base_file)[:16]}")
    nonzero_b = sum(int(bool(p.detach().abs().sum() > 0)) for n, p in adapters.items() if "lora_B" in n)
    print(
        f"adapter tensors: {len(adapters)} ({sum(p.numel() for p in adapters.values()):,} values), lora_B non-zero "
        f"(initialised at 0): {nonzero_b} of {sum('lora_B' in n for n in adapters)}"
    )
    size = sum(t.numel() * t.element_size() for t in state.values())
    print(
        f"last.ckpt state_dict: {len(state)} tensors, all adapter tensors: {all('.lora_' in k for k in state)}, "
        f"{size / 2**20:.2f} MiB vs base weights {base_file.stat().st_size / 2**20:.2f} MiB"
    )


if __name__ == "__main__":
    main()
