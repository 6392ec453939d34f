"""The rollout worker process: its copy of the policy, the shared-memory weight slots, and its loop.

Everything here runs in the worker (a child of the training process) except :class:`SharedWeights`,
which both sides hold. The worker samples a round with :class:`RolloutSampler`, a stand-in for the module that carries
what :meth:`~lit_trainer.modules.grpo._rollouts.GRPORolloutMixin._sample_round` reads (the model, tokenizer, tools,
environments, engine and hyperparameters), so the worker runs the module's own sampling code.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor


class SharedWeights:
    """``slots`` copies of the trainable weights in shared CPU memory, each tagged with the version it holds.

    Version ``v`` lives in slot ``v % slots``. With ``slots = max_staleness + 1`` a slot is overwritten only once no
    round can still need its version (module docstring of :mod:`lit_trainer.modules.grpo._async`), so neither side
    ever waits for the other to copy.

    Args:
        weights: the trainable parameters by name (their shapes and dtypes; LoRA: the adapters only).
        slots: how many versions are held at once.
    """

    def __init__(self, weights: dict[str, Tensor], slots: int) -> None:
        self.names = list(weights)
        self.slots = [
            {name: torch.empty(t.shape, dtype=t.dtype).share_memory_() for name, t in weights.items()}
            for _ in range(slots)
        ]
        self.versions = torch.full((slots,), -1, dtype=torch.long).share_memory_()

    @torch.no_grad()
    def publish(self, version: int, weights: dict[str, Tensor]) -> None:
        """Copy ``weights`` into the slot of ``version`` (GPU tensors are copied down). FSDP2 shards are gathered
        one parameter at a time (a collective: every rank publishes), so no rank holds a whole extra copy on its
        device."""
        from lit_trainer.core.sharding import full

        slot = version % len(self.slots)
        self.versions[slot] = -1  # mid-copy: readers refuse the slot
        for name in self.names:
            self.slots[slot][name].copy_(full(weights[name].detach()))
        self.versions[slot] = version

    def read(self, version: int) -> dict[str, Tensor]:
        """The tensors of ``version`` (shared memory, do not modify).

        Raises:
            RuntimeError: the slot holds another version (overwritten, or never published).
        """
        slot = version % len(self.slots)
        held = int(self.versions[slot])
        if held != version:
            raise RuntimeError(f"weights version {version} is not in shared memory (its slot holds {held}).")
        return self.slots[slot]


@dataclass
class WorkerSpec:
    """What the worker builds its sampler from (pickled to the child; tensors travel through shared memory)."""

    module_class: type
    model: Any
    tokenizer: Any
    hparams: dict[str, Any]
    tools: list[Any]
    environments: Any
    continuous_batching: bool
    engine: str | None
    steps_per_generation: int
    device: str
    threads: int


class RolloutSampler:
    """The module's sampling and scoring-forward code on the worker's own model (built from a :class:`WorkerSpec`).

    It borrows the module class's methods (those of :class:`~lit_trainer.modules.grpo._rollouts.GRPORolloutMixin`,
    ``completion_logps`` and ``score_tokens``; the agentic rounds are
    :class:`~lit_trainer.generation.RolloutGenerator`'s): the worker runs the same code as a synchronous round, one
    process on its own (``trainer.world_size == 1``).
    """

    def __init__(self, spec: WorkerSpec) -> None:
        from lightning.fabric.utilities.data import AttributeDict

        from lit_trainer.data.prompt import RolloutGeometry
        from lit_trainer.generation import RolloutGenerator, SamplingOptions, make_engine

        self.device = torch.device(spec.device)
        self.model = spec.model.to(self.device)
        self.model.requires_grad_(False)
        self.tokenizer = spec.tokenizer
        self.hparams = AttributeDict(spec.hparams)
        self.tools = spec.tools
        self.environments = spec.environments
        self.agentic = bool(self.tools) or self.environments is not None
        self.rollout_func = None
        self.continuous_batching = spec.continuous_batching
        options = self.hparams.get("transformers_continuous_batching_config")
        self.engine = make_engine(spec.continuous_batching, options, spec.engine)
        self.rollouts = RolloutGenerator(self.engine, SamplingOptions.from_hparams(self.hparams), self.tokenizer)
        self.rollout_geometry = RolloutGeometry(1, spec.steps_per_generation, 1, 1)
        self.trainer = SimpleNamespace(world_size=1)
        self.global_rank = 0


def _bind_module_methods(module_class: type) -> None:
    """Give :class:`RolloutSampler` the methods of the module's class that sampling and scoring use: those of the two
    rollout mixins, ``completion_logps`` and ``score_tokens``, looked up on ``module_class`` so that a subclass's
    overrides run in the worker too."""
    from lit_trainer.modules.grpo._rollouts import GRPORolloutMixin

    names = {"completion_logps", "score_tokens"}
    names.update(n for n, v in vars(GRPORolloutMixin).items() if callable(v) and not n.startswith("__"))
    for name in names:
        setattr(RolloutSampler, name, getattr(module_class, name))


@dataclass
class RoundRequest:
    """One round to generate: its index, the weights version to use, the prompt batch, the sampling seed and the
    policy's train/eval mode (dropout, as the synchronous round samples in the module's mode)."""

    round_index: int
    version: int
    batch: dict[str, Any]
    seed: int
    training: bool = True


def sample_request(sampler: RolloutSampler, weights: SharedWeights, loaded: int, request: RoundRequest) -> tuple:
    """Load the request's weights version (if not loaded), sample the round, and score its tokens with the same
    chunked forward the trainer uses (the behaviour log-probs). Returns ``(loaded version, result)``."""
    if request.version != loaded:
        sampler.engine.load_weights(sampler.model, weights.read(request.version).items())
        loaded = request.version
    sampler.model.train(request.training)
    batch = move_data_to_device(request.batch, sampler.device)
    with torch.no_grad():
        rows, completions, scoring_batch, decoded, tool_metrics = sampler._sample_round(batch, request.seed)
        # the first prompt group alone (the trainer's sampler check scores it with the same shapes), then the rest in
        # chunks of one micro-batch
        group = sampler.hparams.num_generations
        head = {k: v[:group] for k, v in rows.items()}
        behaviour = sampler.completion_logps(sampler.model, head)[0]
        if rows["prompt_ids"].shape[0] > group:
            tail = sampler._chunked_logps(sampler.model, {k: v[group:] for k, v in rows.items()})
            behaviour = torch.cat([behaviour, tail])  # the rows are not trimmed: every chunk has the full width
    result = {
        "rows": rows,
        "completions": completions,
        "batch": scoring_batch,
        "decoded": decoded,
        "tool_metrics": tool_metrics,
        "sampling_logps": behaviour,
        "version": request.version,
    }
    return loaded, move_data_to_device(result, "cpu")


class Deferred:
    """A value pickled with a process's arguments but unpickled only when the process calls :meth:`load`.

    The worker unpickles its :class:`WorkerSpec` this way, inside the ``try`` that reports its errors: a class it cannot
    import (the module's, a tool's or an environment's, defined in a notebook or in a module only the training process
    can import) then reaches the trainer as a traceback, instead of killing the process before it can report anything.
    Tensors are pickled as when they are arguments (shared memory, their handles sent with the process); a value never
    pickled (a ``fork`` start) is returned as it is.
    """

    def __init__(self, value: Any = None, data: bytes | None = None) -> None:
        self.value, self.data = value, data

    def __reduce__(self) -> tuple:
        return Deferred, (None, bytes(ForkingPickler.dumps(self.value)))

    def load(self) -> Any:
        return self.value if self.data is None else pickle.loads(self.data)


def exit_with(parent: Any) -> None:
    """Wait until the ``parent`` process is gone, then end this process at once (run in a daemon thread)."""
    parent.join()  # returns when the parent's end of the sentinel pipe closes: it exited or was killed
    os._exit(0)


def worker_main(spec: WorkerSpec | Deferred, requests: Any, results: Any, weights: SharedWeights) -> None:
    """The worker loop: take a request, sample it, put ``(round, "ok", result)`` or ``(round, "error", text)``; a
    failure to start (``spec`` does not unpickle, the sampler cannot be built) is ``(-1, "error", text)``.

    Ctrl-C and SIGTERM are left to the training process (which stops the worker after saving); the worker exits on a
    ``None`` request, or by itself as soon as the training process is gone (killed), whatever it is doing (sampling,
    the log-prob pass, waiting): a thread waits on the parent's sentinel and ends the process, so it is never orphaned.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the trainer's to handle (it stops the worker after saving)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=exit_with, args=(parent,), name="lit-rollouts-parent", daemon=True).start()
    results.put((-1, "started", os.getpid()))
    try:
        spec = spec.load() if isinstance(spec, Deferred) else spec
        torch.set_num_threads(spec.threads)
        _bind_module_methods(spec.module_class)
        sampler = RolloutSampler(spec)
    except BaseException:  # the trainer raises it with the worker's traceback
        results.put((-1, "error", traceback.format_exc()))
        return
    loaded = -1
    while (request := requests.get()) is not None:
        try:
            loaded, result = sample_request(sampler, weights, loaded, request)
            results.put((request.round_index, "ok", result))
        except BaseException:  # the trainer raises it with the worker's traceback
            results.put((request.round_index, "error", traceback.format_exc()))
