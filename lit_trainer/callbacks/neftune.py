"""NEFTune: uniform noise on the input embeddings during training (Jain et al., 2023).

Reference: ``transformers`` ``neftune_noise_alpha`` (docs/design.md#hf-neftune). What is the
same: the noise ``U(-m, m)`` with ``m = noise_alpha / sqrt(L * d)`` (``L`` the padded length of the batch, ``d`` the
embedding size) is added to the output of the input-embedding module, only while that module is in training mode.
What differs, on purpose:

* the hook is removed at the end of ``fit`` *and* when ``fit`` raises (the reference leaves it on after an
  exception), so validation, prediction, export and a later ``trainer.validate`` never see noise;
* no noise is added under ``torch.no_grad()`` / ``inference_mode`` (for example rollouts that a GRPO module
  generates while the model is in training mode);
* the draws come from a dedicated ``torch.Generator``, not the global RNG, so turning NEFTune on does not shift
  dropout or data-order randomness, and the draws are resumable (see below);
* ``mask_padding=True`` (off by default) noises only real tokens with ``L`` counted per sequence, as in the
  NEFTune paper's masked variant; the reference noises padding positions too.

Exact resume: before each draw the generator is re-seeded with a hash of ``(seed, global_rank, draw_index)``.
``state_dict()`` holds ``seed`` and the number of draws made so far (primitives), so a resumed run continues
the same noise sequence on every rank, and different ranks never share noise.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lit_trainer.core.lightning_namespace import PackageBound
from lit_trainer.core.seeding import derive_seed


def draw_seed(seed: int, rank: int, index: int) -> int:
    """The generator seed of draw ``index`` on ``rank``: a hash, so nearby inputs give unrelated streams.

    Args:
        seed: The run's NEFTune seed.
        rank: Global rank of the process.
        index: How many noise draws this process made before this one.

    Returns:
        A 63-bit non-negative seed for ``torch.Generator.manual_seed``.
    """
    return derive_seed(seed, rank, index)


def neftune_noise(embeds: Tensor, noise_alpha: float, generator: torch.Generator, mask: Tensor | None = None) -> Tensor:
    """The NEFTune noise for one embedding output.

    Without ``mask``: ``U(-m, m)`` i.i.d. per element, ``m = noise_alpha / sqrt(L * d)``, ``(L, d) = embeds.shape[1:]``.
    With ``mask`` (``[B, L]``, nonzero = real token): element ``(i, t, :)`` gets ``U(-1, 1) * m_i * mask[i, t]``
    with ``m_i = noise_alpha / sqrt(L_i * d)`` and ``L_i = mask[i].sum()`` (1 if the row is all padding).

    Args:
        embeds: Embedding output, shape ``[B, L, d]``.
        noise_alpha: NEFTune's alpha.
        generator: Source of the draws, on ``embeds.device``.
        mask: Optional attention mask, shape ``[B, L]``.

    Returns:
        A tensor shaped and typed like ``embeds``.
    """
    seq_len, dim = embeds.shape[1], embeds.shape[2]
    if mask is None:
        bound = noise_alpha / math.sqrt(seq_len * dim)
        return torch.empty_like(embeds).uniform_(-bound, bound, generator=generator)
    real = (mask != 0).to(embeds.dtype)
    lengths = real.sum(dim=1).clamp_min(1.0)
    scale = noise_alpha / torch.sqrt(lengths * dim)
    unit = torch.empty_like(embeds).uniform_(-1.0, 1.0, generator=generator)
    return unit * (scale[:, None, None] * real[:, :, None])


def _resolve_path(root: nn.Module, path: str) -> nn.Module:
    """Follow a dotted attribute path from ``root`` to a module."""
    obj: Any = root
    for part in path.split("."):
        if not hasattr(obj, part):
            raise AttributeError(
                f"`NEFTune(embedding_path={path!r})`: {type(obj).__name__} has no attribute {part!r}. "
                "Give the dotted path of the input embedding from the LightningModule, e.g. 'model.model.embed_tokens'."
            )
        obj = getattr(obj, part)
    if not isinstance(obj, nn.Module):
        raise TypeError(f"`NEFTune(embedding_path={path!r})` points to a {type(obj).__name__}, not a torch.nn.Module.")
    return obj


def find_input_embedding(pl_module: nn.Module, embedding_path: str | None = None) -> nn.Module:
    """Find the input-embedding module of ``pl_module``.

    Args:
        pl_module: Any module, usually a LightningModule.
        embedding_path: Optional dotted attribute path from ``pl_module``; used instead of the lookup.

    Returns:
        ``embedding_path``'s module, else ``pl_module.get_input_embeddings()``, else
        ``pl_module.model.get_input_embeddings()``.

    Raises:
        AttributeError: If nothing is found (the message says how to fix it).
        TypeError: If ``embedding_path`` leads to something that is not a ``torch.nn.Module``.
    """
    if embedding_path is not None:
        return _resolve_path(pl_module, embedding_path)
    for candidate in (pl_module, getattr(pl_module, "model", None)):
        getter = getattr(candidate, "get_input_embeddings", None)
        if callable(getter):
            found = getter()
            if isinstance(found, nn.Module):
                return found
    raise AttributeError(
        f"NEFTune could not find the input embedding of {type(pl_module).__name__}: neither the module nor its "
        "`.model` has a `get_input_embeddings()` returning a torch.nn.Module. Add that method, or pass "
        "`NEFTune(embedding_path='dotted.path.to.embedding')`."
    )


def _ancestors(root: nn.Module, target: nn.Module) -> list[nn.Module]:
    """The modules on the path from ``root`` down to ``target`` (excluded); empty if ``target`` is not inside."""
    name = next((n for n, m in root.named_modules(remove_duplicate=False) if m is target), None)
    if name is None:
        return []
    parts = name.split(".") if name else []
    return [root.get_submodule(".".join(parts[:i])) for i in range(len(parts))]


def _mask_from_batch(batch: Any) -> Tensor | None:
    value = batch.get("attention_mask") if isinstance(batch, Mapping) else getattr(batch, "attention_mask", None)
    return value if isinstance(value, Tensor) else None


class _MaskCapture:
    """Remembers the 2-D ``attention_mask`` passed to the embedding's ancestor modules' ``forward``.

    A forward pre-hook on every ancestor of the embedding (the LightningModule, an HF ``...ForCausalLM`` and its
    inner model) pushes the mask it received (keyword or positional) on a stack; the matching forward hook pops it.
    The embedding hook then reads the innermost mask seen on the current call path. The training batch's
    ``attention_mask`` (set by the callback in ``on_train_batch_start``) is the fallback.
    """

    def __init__(self) -> None:
        self.stack: list[Tensor | None] = []
        self.batch_mask: Tensor | None = None
        self._signatures: dict[int, inspect.Signature | None] = {}

    def _mask_arg(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        if "attention_mask" in kwargs:
            value = kwargs["attention_mask"]
        else:
            key = id(module)
            if key not in self._signatures:
                try:
                    self._signatures[key] = inspect.signature(module.forward)
                except (TypeError, ValueError):
                    self._signatures[key] = None
            sig = self._signatures[key]
            try:
                value = sig.bind_partial(*args).arguments.get("attention_mask") if sig else None
            except TypeError:
                value = None
        return value if isinstance(value, Tensor) and value.dim() == 2 else None

    def push(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.stack.append(self._mask_arg(module, args, kwargs))

    def pop(self, *_: Any) -> None:
        if self.stack:
            self.stack.pop()

    def current(self) -> Tensor | None:
        for mask in reversed(self.stack):
            if mask is not None:
                return mask
        return self.batch_mask


class _NEFTune(PackageBound):
    """Add NEFTune noise to the input embeddings while training.

    Works on any LightningModule whose input embedding can be found (see ``find_input_embedding``). The hook is
    attached in ``on_train_start`` and removed in ``on_train_end``, ``on_fit_end`` and ``on_exception``.

    Args:
        noise_alpha: NEFTune's alpha (the reference's ``neftune_noise_alpha``); the noise bound is
            ``noise_alpha / sqrt(L * d)``. Typical values 5-15.
        embedding_path: Dotted attribute path of the embedding module from the LightningModule
            (e.g. ``"model.model.embed_tokens"``); by default ``get_input_embeddings()`` of the module or of its
            ``.model`` is used.
        mask_padding: Noise only real tokens and count ``L`` per sequence. The mask is the ``attention_mask``
            given to the forward of a module that contains the embedding, else the training batch's
            ``"attention_mask"`` entry; a missing or mis-shaped mask raises an error.
        seed: Seed of the noise generator; ``None`` takes ``torch.initial_seed()`` when training starts (the seed
            of ``seed_everything``). Kept in the callback state, so a resumed run keeps the original seed.

    Raises:
        ValueError: If ``noise_alpha`` is not a positive finite number.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[NEFTune(noise_alpha=5.0)], logger=False)  # doctest: +SKIP
    """

    def __init__(
        self,
        noise_alpha: float,
        embedding_path: str | None = None,
        mask_padding: bool = False,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if not (isinstance(noise_alpha, (int, float)) and math.isfinite(noise_alpha) and noise_alpha > 0):
            raise ValueError(f"`NEFTune(noise_alpha={noise_alpha!r})` is invalid: noise_alpha must be a number > 0.")
        self.noise_alpha = float(noise_alpha)
        self.embedding_path = embedding_path
        self.mask_padding = mask_padding
        self.seed = seed
        self._active_seed: int | None = seed
        self._draws = 0
        self._rank = 0
        self._handles: list[RemovableHandle] = []
        self._masks = _MaskCapture()
        self._generators: dict[torch.device, torch.Generator] = {}

    @property
    def is_attached(self) -> bool:
        """Whether the noise hook is currently registered."""
        return bool(self._handles)

    def attach(self, pl_module: nn.Module, rank: int = 0) -> None:
        """Register the noise hook on ``pl_module``'s input embedding (idempotent; the hooks call this).

        Args:
            pl_module: The module to train.
            rank: Global rank of this process (different ranks draw different noise).

        Raises:
            AttributeError: If no input embedding is found.
        """
        self.detach()
        embedding = find_input_embedding(pl_module, self.embedding_path)
        if self._active_seed is None:
            self._active_seed = int(torch.initial_seed())
        self._rank = rank
        self._handles.append(embedding.register_forward_hook(self._noise_hook))
        if self.mask_padding:
            for module in _ancestors(pl_module, embedding):
                self._handles.append(module.register_forward_pre_hook(self._masks.push, with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._masks.pop, always_call=True))

    def detach(self) -> None:
        """Remove every hook this callback registered (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._masks.stack.clear()
        self._masks.batch_mask = None

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    def _noise_hook(self, module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        if not isinstance(output, Tensor) or output.dim() != 3:
            shape = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
            raise ValueError(f"NEFTune expects the input embedding to return [batch, length, dim]; got {shape}.")
        mask = self._checked_mask(output) if self.mask_padding else None
        generator = self._generator(output.device)
        generator.manual_seed(draw_seed(self._active_seed or 0, self._rank, self._draws))
        self._draws += 1
        return output + neftune_noise(output, self.noise_alpha, generator, mask)

    def _checked_mask(self, output: Tensor) -> Tensor:
        mask = self._masks.current()
        if mask is None:
            raise ValueError(
                "`NEFTune(mask_padding=True)` found no attention_mask: pass `attention_mask=` to the forward of the "
                "model that owns the embedding, or put an 'attention_mask' entry in the training batch."
            )
        if tuple(mask.shape) != tuple(output.shape[:2]):
            raise ValueError(
                f"`NEFTune(mask_padding=True)`: attention_mask shape {tuple(mask.shape)} does not match the embedding "
                f"output {tuple(output.shape[:2])}. Pass the matching mask as `attention_mask=` to the model forward."
            )
        return mask.to(output.device)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active_seed is None:
            # every rank must use rank 0's seed: only rank 0's callback state is checkpointed, so a per-rank
            # torch.initial_seed() would give the other ranks a different noise stream after a resume
            self._active_seed = int(trainer.strategy.broadcast(int(torch.initial_seed()), src=0))
        self.attach(pl_module, rank=trainer.global_rank)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.mask_padding:
            self._masks.batch_mask = _mask_from_batch(batch)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._masks.batch_mask = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.detach()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.detach()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.detach()

    @property
    @override
    def state_key(self) -> str:
        """``NEFTune{'embedding_path': ...}``: callbacks on different embeddings keep separate checkpoint states
        (a checkpoint keyed ``NEFTune``, from earlier versions, still loads through Lightning's legacy key)."""
        return self._generate_state_key(embedding_path=self.embedding_path)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"seed": self._active_seed, "draws": self._draws, "noise_alpha": self.noise_alpha}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._active_seed = state_dict["seed"] if self.seed is None else self.seed
        self._draws = int(state_dict["draws"])


class NEFTune(_NEFTune, Callback):
    __doc__ = _NEFTune.__doc__
