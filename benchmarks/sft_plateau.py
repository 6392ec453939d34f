"""The main job's plateau, fast: a plain torch copy of configs/sft.yaml's training with one knob changed at a time.

Trains a Llama preset shape on the built-in addition task (prompt ``"a+b="``, loss on the answer and EOS only), batch
64, AdamW (decay on matrices, not on norms), gradient clipping 1.0, linear warmup then cosine, one process per call;
prints greedy exact match on the 500 held-out problems every ``--every`` steps, one JSON line per seed. It is the tool
behind the table in docs/quickstart.md#at-every-seed (which knob removes the plateau); the recipe itself is measured
through ``lit-trainer`` by ``benchmarks/sft_seeds.py``. Results move with the CPU and thread count (rounding), which
is the point: run several seeds.

Usage: python benchmarks/sft_plateau.py [--seeds 1 2 3] [--steps 1500] [--init 0.1] [--weight-decay 0.1] ...
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from lit_trainer.data import builtin
from lit_trainer.models import PRESETS, Preset, build_preset_model, build_tokenizer


def encode(tokenizer, split: str, answer_format: str) -> list[tuple[list[int], list[int], str]]:
    """``(prompt ids, answer ids + EOS, answer)`` of every problem of ``split``."""
    rows = []
    for a, b in builtin.addition_problems(split):
        answer = str(a + b).zfill(3) if answer_format == "padded" else str(a + b)
        answer_ids = tokenizer(answer)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((tokenizer(f"{a}+{b}=")["input_ids"], answer_ids, answer))
    return rows


def exact_match(model, tokenizer, prompts: torch.Tensor, answers: list[str]) -> float:
    """Greedy exact match: 4 new tokens, the answer then EOS."""
    model.eval()
    with torch.no_grad():
        ids = prompts
        for _ in range(4):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    model.train()
    texts = tokenizer.batch_decode(ids[:, prompts.shape[1] :])
    return sum("</s>" in t and t.split("</s>")[0] == a for t, a in zip(texts, answers)) / len(answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--init", type=float, default=0.1, help="initial std (the tiny preset's; 0.02 formerly)")
    parser.add_argument("--attention-bias", action="store_true")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--answer-format", choices=["plain", "padded"], default="plain")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = build_tokenizer()
    train = encode(tokenizer, "train", args.answer_format)
    validation = encode(tokenizer, "validation", args.answer_format)
    width = max(len(p) + len(c) for p, c, _ in train)
    ids = torch.zeros(len(train), width, dtype=torch.long)  # pad id 0, never a label
    labels = torch.full((len(train), width), -100)
    for i, (prompt, answer, _) in enumerate(train):
        ids[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[i, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
    prompts = torch.tensor([p for p, _, _ in validation])  # all 6 tokens long
    answers = [a for _, _, a in validation]

    def schedule(step: int) -> float:
        if step < args.warmup:
            return step / args.warmup
        return 0.5 * (1 + math.cos(math.pi * (step - args.warmup) / max(1, args.steps - args.warmup)))

    PRESETS["sft-plateau"] = Preset(args.hidden, args.intermediate, 2, args.heads, initializer_range=args.init)
    for seed in args.seeds:
        torch.manual_seed(seed)
        model = build_preset_model("sft-plateau", attention_bias=args.attention_bias)
        groups = [
            {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": args.weight_decay},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=args.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        generator = torch.Generator().manual_seed(seed)
        order, position, history, began = torch.randperm(len(train), generator=generator), 0, [], time.monotonic()
        for step in range(1, args.steps + 1):
            if position + 64 > len(order):
                order, position = torch.randperm(len(train), generator=generator), 0
            batch = order[position : position + 64]
            position += 64
            model(ids[batch], labels=labels[batch]).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if step % args.every == 0:
                history.append((step, round(exact_match(model, tokenizer, prompts, answers), 3)))
        print(
            json.dumps({"seed": seed, "exact_match": history, "seconds": round(time.monotonic() - began)}), flush=True
        )


if __name__ == "__main__":
    main()
