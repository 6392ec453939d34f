"""The output head alone: full logits + cross entropy vs the chunked functions, forward and backward, interleaved.

    OMP_NUM_THREADS=2 python benchmarks/chunked_head.py [--tokens 2048] [--hidden 64] [--vocab 151936] [--rounds 3]

``full`` is today's full-logits path (``cross_entropy`` of ``hidden @ weight.T``, summed); ``sum<c>`` is
``chunked_logp_sum`` (SFT: gradients formed in the forward pass) and ``tok<c>`` is ``chunked_token_logps`` (DPO and
GRPO: logits recomputed in the backward pass), each with ``c`` tokens per chunk (110 is the default at 151,936
entries). The runners alternate within each round, so a busy machine slows them alike; the best round after the
first (a warm-up) is reported, in seconds.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from lit_trainer.losses.chunked import chunked_logp_sum, chunked_token_logps, default_chunk_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    n = args.tokens
    hidden = torch.randn(n, args.hidden, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden) / 8).requires_grad_()
    targets = torch.randint(0, args.vocab, (n,))
    ones = torch.ones(n)
    runners = {"full": lambda: F.cross_entropy(hidden @ weight.T, targets, reduction="sum").backward()}
    for c in sorted({default_chunk_size(args.vocab), 256, 512}):
        runners[f"sum{c}"] = lambda c=c: chunked_logp_sum(hidden, weight, targets, ones, chunk_size=c).backward()
        runners[f"tok{c}"] = lambda c=c: chunked_token_logps(hidden, weight, targets, chunk_size=c)[0].sum().backward()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    best_full = min(times["full"][1:] or times["full"])
    print(f"{n} tokens, hidden {args.hidden}, vocabulary {args.vocab}, {torch.get_num_threads()} threads")
    print("| head | seconds | vs full |\n|---|---|---|")
    for name, values in times.items():
        best = min(values[1:] or values)
        print(f"| {name} | {best:.2f} | {best / best_full:.2f}x |")


if __name__ == "__main__":
    main()
