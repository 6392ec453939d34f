"""The rollout worker process: its copy of the policy, the shared-memory weight slots, and its loop.

Everything here runs in the worker (a child of the training process) except :class:`SharedWeights`,
which both sides hold. The worker gets a :class:`WorkerSpec` (the rollout generator's inputs: the policy, tokenizer,
sampling options, engine, tools, environments and the behaviour scorer) and builds from it its own
:class:`~lit_trainer.generation.RolloutGenerator` (:class:`WorkerRounds`): a round is the generator's
:meth:`~lit_trainer.generation.RolloutGenerator.sample_round`, as in the training process, and its behaviour log-probs
the scorer's forward in the trainer's chunks (:func:`~lit_trainer.modules.online_rl._logps.chunked_logps`).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor

from lit_trainer.generation import RolloutGenerator, SamplingOptions, make_engine
from lit_trainer.modules.online_rl._logps import chunked_logps


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

    def holds(self, version: int) -> bool:
        """Whether the slot of ``version`` holds it (published whole, not overwritten since)."""
        return int(self.versions[version % len(self.slots)]) == version

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
    """The rollout generator's inputs, from which the worker builds its own (pickled to the child; tensors travel
    through shared memory): no module, only what a round reads.

    Args:
        model: a hook-free CPU copy of the policy (moved to ``device`` in the worker).
        tokenizer: the policy's tokenizer.
        options: the round's sampling options (the module's ``self.rollouts.options``).
        continuous_batching: sample with transformers' continuous batching.
        continuous_batching_config: its ``ContinuousBatchingConfig`` fields.
        engine: "vllm", the import path of a :class:`~lit_trainer.generation.RolloutEngine` subclass, or None.
        engine_options: keyword arguments of that engine's class.
        tools: the tool functions.
        environments: the run's environments, or None.
        scorer: the behaviour log-prob forward, ``(model, rows) -> (B, C)`` (the module's
            :meth:`~lit_trainer.modules.grpo.GRPOModule.behaviour_scorer`).
        group: rows scored alone first (``num_generations``: the rows the trainer's sampler check scores).
        steps_per_generation: micro-batches per round (the other rows are scored in chunks of one micro-batch).
        owner: the module's class name, named in the agentic rounds' messages.
        device: the worker's device.
        threads: its CPU threads.
    """

    model: Any
    tokenizer: Any
    options: SamplingOptions
    continuous_batching: bool
    continuous_batching_config: dict[str, Any] | None
    engine: str | None
    engine_options: dict[str, Any] | None
    tools: list[Any]
    environments: Any
    scorer: Callable[[Any, dict[str, Tensor]], Tensor]
    group: int
    steps_per_generation: int
    owner: str
    device: str
    threads: int


@dataclass
class RoundRequest:
    """One round to generate: its index, the weights version to use, the prompt batch, the sampling seed and the
    policy's train/eval mode (dropout, as the synchronous round samples in the module's mode)."""

    round_index: int
    version: int
    batch: dict[str, Any]
    seed: int
    training: bool = True


class WorkerRounds:
    """The worker's side of a round, built from a :class:`WorkerSpec`: its copy of the policy on its device and a
    :class:`~lit_trainer.generation.RolloutGenerator` of its own, whose
    :meth:`~lit_trainer.generation.RolloutGenerator.sample_round` is the one the module runs in a synchronous round
    (one process: no collective)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.device = torch.device(spec.device)
        self.model = spec.model.to(self.device)
        self.model.requires_grad_(False)
        engine = make_engine(
            spec.continuous_batching, spec.continuous_batching_config, spec.engine, spec.engine_options
        )
        self.rollouts = RolloutGenerator(engine, spec.options, spec.tokenizer)
        self.loaded = -1  # the weights version the model holds

    def sample(self, weights: SharedWeights, request: RoundRequest) -> dict[str, Any]:
        """Load the request's weights version (if not loaded), sample the round, and score its tokens with the
        scorer in the trainer's chunks (the behaviour log-probs); the result on the CPU."""
        spec = self.spec
        if request.version != self.loaded:
            self.rollouts.engine.load_weights(self.model, weights.read(request.version).items())
            self.loaded = request.version
        self.model.train(request.training)
        batch = move_data_to_device(request.batch, self.device)
        with torch.no_grad():
            sampled = self.rollouts.sample_round(
                self.model, batch, request.seed, device=self.device, tools=spec.tools,
                environments=spec.environments, owner=spec.owner,
            )  # fmt: skip
            rows, count = sampled.rows, sampled.rows["prompt_ids"].shape[0]
            # an engine that returns its own log-probs of a plain round's tokens (vLLM) gives the behaviour log-probs;
            # otherwise: the first prompt group alone (the trainer's sampler check scores it with the same shapes),
            # then the rest in chunks of one micro-batch (the rows are not trimmed: every chunk has the full width)
            engine_logps = sampled.completions.logps if sampled.decoded is None else None
            if engine_logps is not None:
                behaviour = engine_logps.float() * rows["completion_mask"]
            else:
                behaviour = spec.scorer(self.model, {k: v[: spec.group] for k, v in rows.items()})
            if engine_logps is None and count > spec.group:
                tail = {k: v[spec.group :] for k, v in rows.items()}
                size = max(1, (count - spec.group) // spec.steps_per_generation)
                behaviour = torch.cat([behaviour, chunked_logps(spec.scorer, self.model, tail, size)])
        result = {**sampled._asdict(), "sampling_logps": behaviour, "version": request.version}
        return move_data_to_device(result, "cpu")


class Deferred:
    """A value pickled with a process's arguments but unpickled only when the process calls :meth:`load`.

    The worker unpickles its :class:`WorkerSpec` this way, inside the ``try`` that reports its errors: a class it cannot
    import (a tool's, an environment's or the behaviour scorer's, defined in a notebook or in a module only the
    training process can import) then reaches the trainer as a traceback, instead of killing the process before it can
    report anything.
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


def worker_main(requests: Any, results: Any) -> None:
    """The worker loop: the first request is ``(spec, weights)`` (the :class:`WorkerSpec`, possibly
    :class:`Deferred`, and the :class:`SharedWeights`); then take a request, sample it, put ``(round, "ok", result)``
    or ``(round, "error", text)``. A failure to start (the spec does not unpickle, the policy or engine cannot be set
    up) is ``(-1, "error", text)``.

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
        spec, weights = requests.get()
        spec = spec.load() if isinstance(spec, Deferred) else spec
        torch.set_num_threads(spec.threads)
        rounds = WorkerRounds(spec)
    except BaseException:  # the trainer raises it with the worker's traceback
        results.put((-1, "error", traceback.format_exc()))
        return
    try:
        while (request := requests.get()) is not None:
            try:
                results.put((request.round_index, "ok", rounds.sample(weights, request)))
            except BaseException:  # the trainer raises it with the worker's traceback
                results.put((request.round_index, "error", traceback.format_exc()))
    finally:  # an engine with a process of its own (vLLM's server) stops with the worker
        close = getattr(rounds.rollouts.engine, "close", None)
        if close is not None:
            close()
