"""Precomputed reference log-probs for DPO and KTO (TRL's ``precompute_ref_log_probs``, docs/design.md#trl-dpo), the
precompute part of :class:`~lit_trainer.modules.reference.ReferenceModel`.

Before training, the reference model (or, without one, the policy before any update) scores every pair of the
training and validation data once; the per-pair sums are stored with the dataset as ``ref_chosen_logps`` /
``ref_rejected_logps`` columns (KTO: a row's and its KL partner's, ``ref_logps`` / ``ref_KL_logps``), so the
reference model can be freed and the training steps skip its forward pass.

Keying: ``sha256(data fingerprint, reference fingerprint, ld_alpha)``. The data fingerprint is a content hash of the
tokenized pairs and the truncation settings (``PreferenceDataModule.fingerprint``); the reference fingerprint
(:func:`reference_sha256`) hashes the reference's weights (names, dtypes, shapes, bytes) AND everything else that
decides its forward: the model class, its config (rope, sliding window, ... and the attention implementation), the
trainer's precision (autocast) and the torch/transformers versions. So a changed model (weights, config or dtype),
precision, dataset, ``max_length``, ``truncation_mode`` or ``ld_alpha`` recomputes. Results are kept (a) on the data
module, with their key, so a second ``fit`` with the same data and reference skips the pass; (b) on disk as
``<dir>/ref_logps-<key>.safetensors`` when a directory is known (``ref_logps_cache_dir``, else next to the dataset's
own ``datasets`` cache files, which exist for data loaded from files or the hub); (c) in every checkpoint, so a
resumed run reuses them even though the policy they came from has been trained since.

Distributed: each rank scores its strided shard ``rank::world`` and the shards are all-gathered (one collective per
split); rank 0 writes the cache file; all ranks end with the same columns.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import transformers
from lightning.pytorch.utilities import rank_zero_info
from safetensors.torch import load_file, save_file
from torch import Tensor

from lit_trainer.core.atomic import atomic_write

CKPT_KEY = "dpo_reference_logps"
_FORWARD_KEYS = ("input_ids", "attention_mask", "completion_mask")


def state_dict_sha256(model: torch.nn.Module) -> str:
    """sha256 over the names, dtypes, shapes and bytes of ``model.state_dict()``."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def forward_sha256(model: torch.nn.Module, precision: str) -> str:
    """sha256 of what, besides the weights, decides the model's log-probs: its class, its config (without the name
    or path it was loaded from) including the attention implementation, the autocast ``precision`` and the
    torch/transformers versions."""
    config = getattr(model, "config", None)
    settings = config.to_dict() if config is not None else {}
    for key in ("_name_or_path", "transformers_version"):
        settings.pop(key, None)
    settings["_attn_implementation"] = getattr(config, "_attn_implementation", None)
    described = {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": settings,
        "precision": str(precision),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


def reference_sha256(model: torch.nn.Module, precision: str) -> str:
    """The reference fingerprint of the cache key: :func:`state_dict_sha256` and :func:`forward_sha256`."""
    return f"{state_dict_sha256(model)}|{forward_sha256(model, precision)}"


def reference_key(data_fingerprint: str, model_sha256: str, ld_alpha: float | None) -> str:
    """The cache key of one split's reference log-probs (``model_sha256``: :func:`reference_sha256`)."""
    text = f"lit_trainer-ref-logps-v2|{data_fingerprint}|{model_sha256}|ld_alpha={ld_alpha}"
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def cache_path(directory: str | os.PathLike, key: str) -> Path:
    """``<directory>/ref_logps-<key>.safetensors``."""
    return Path(directory) / f"ref_logps-{key}.safetensors"


def load_cached(directory: str | os.PathLike | None, key: str) -> tuple[Tensor, Tensor] | None:
    """``(chosen, rejected)`` from the cache file of ``key``, or None when there is none."""
    if directory is None or not cache_path(directory, key).is_file():
        return None
    tensors = load_file(str(cache_path(directory, key)))
    return tensors["chosen"], tensors["rejected"]


def save_cached(directory: str | os.PathLike, key: str, chosen: Tensor, rejected: Tensor) -> Path:
    """Write the cache file atomically (:func:`lit_trainer.core.atomic.atomic_write`: a crash never leaves a partial
    file under the cache name)."""
    target = cache_path(directory, key)
    with atomic_write(target) as tmp:
        save_file(
            {"chosen": chosen.float().contiguous().cpu(), "rejected": rejected.float().contiguous().cpu()}, str(tmp)
        )
    return target


@torch.no_grad()
def score_pairs(
    logps_fn: Callable[[dict[str, Tensor]], Tensor], batches: Iterable[dict[str, Tensor]], device: torch.device
) -> Tensor:
    """``(n, 2)`` float32 ``[chosen, rejected]`` per-pair log-probs over collated 2B-row batches.

    Args:
        logps_fn: maps a batch (``input_ids``, ``attention_mask``, ``completion_mask`` on ``device``) to the ``(2B,)``
            per-sequence log-probs, chosen rows first.
        batches: collated preference batches, in dataset order.
        device: where the model runs.
    """
    rows = []
    for batch in batches:
        seq = logps_fn({k: batch[k].to(device) for k in _FORWARD_KEYS}).float()
        half = seq.numel() // 2
        rows.append(torch.stack([seq[:half], seq[half:]], dim=1))
    return torch.cat(rows) if rows else torch.zeros(0, 2, device=device)


def gather_strided(local: Tensor, total: int, world: int, all_gather: Callable[[Tensor], Tensor]) -> Tensor:
    """Reassemble ``(total, 2)`` from each rank's rows ``rank::world`` (shards differ by at most one row).

    Args:
        local: this rank's ``(n_rank, 2)`` rows.
        total: rows of the whole split.
        world: number of ranks.
        all_gather: stacks a same-shape tensor from every rank into ``(world, ...)``.
    """
    if world == 1:
        return local
    width = -(-total // world)
    padded = local.new_zeros(width, local.size(1))
    padded[: local.size(0)] = local
    gathered = all_gather(padded)
    out = local.new_empty(total, local.size(1))
    for rank in range(world):
        count = len(range(rank, total, world))
        out[rank::world] = gathered[rank, :count]
    return out


class PrecomputedReference:
    """The precomputed reference log-probs of one module (DPO, KTO): what was computed, with which key, and how.

    ``entries[split] = (key, data fingerprint, chosen, rejected)``; ``restored`` holds the entries of a loaded
    checkpoint; ``released`` is set once the reference model (or the untrained policy standing in for it) is gone.
    The module is duck-typed: ``ref_model``, ``model``, ``trainer``, ``device`` and ``score(model, batch).seq``.

    Args:
        ld_alpha: the module's LD-DPO weight (part of the key: it changes the per-sequence sums; every other forward
            setting is in :func:`reference_sha256`).
        batch_size: pairs per batch of the scoring pass (None: the data module's eval batch size).
        cache_dir: directory of the cache files (None: next to the dataset's ``datasets`` cache files, if any).
    """

    def __init__(self, ld_alpha: float | None, batch_size: int | None, cache_dir: str | None) -> None:
        self.ld_alpha, self.batch_size, self.cache_dir = ld_alpha, batch_size, cache_dir
        self.entries: dict[str, tuple[str, str, Tensor, Tensor]] = {}
        self.restored: dict[str, dict[str, Any]] = {}
        self.released = False

    def ensure(self, module: Any, datamodule: Any, splits: Iterable[str]) -> None:
        """Give every split of ``datamodule`` that has data its reference log-probs (restored, cached or computed)."""
        model_sha: str | None = None
        for split in splits:
            if datamodule.split_dataset(split) is None:
                continue
            done = self.entries.get(split)
            if done is not None and datamodule.reference_logps_key(split) == done[0]:
                continue
            fingerprint = datamodule.fingerprint(split)
            restored = self.restored.get(split)
            if restored is not None and restored["data"] == fingerprint:  # resume: the reference may be gone
                entry = (restored["key"], fingerprint, restored["chosen"], restored["rejected"])
            else:
                model_sha = model_sha or self._reference_sha256(module)
                key = reference_key(fingerprint, model_sha, self.ld_alpha)
                entry = (key, fingerprint, *self._load_or_compute(module, datamodule, split, key))
            datamodule.set_reference_logps(split, entry[2], entry[3], entry[0])
            self.entries[split] = entry

    def _source(self, module: Any) -> torch.nn.Module:
        if module.ref_model is not None:
            return module.ref_model
        if self.released or module.trainer.global_step > 0:
            raise ValueError(
                "Cannot precompute reference log-probs for new data: the reference model was released "
                "(or the policy, which served as reference, has been trained). Pass `ref_model=` "
                "explicitly, or precompute every dataset in the first fit."
            )
        return module.model

    def _reference_sha256(self, module: Any) -> str:
        source = self._source(module)
        digest = reference_sha256(source, module.trainer.precision) if module.trainer.is_global_zero else None
        return module.trainer.strategy.broadcast(digest)

    def _directory(self, datamodule: Any, split: str) -> str | None:
        if self.cache_dir:
            return self.cache_dir
        files = datamodule.split_dataset(split).cache_files
        return os.path.dirname(files[0]["filename"]) if files else None

    def _load_or_compute(self, module: Any, datamodule: Any, split: str, key: str) -> tuple[Tensor, Tensor]:
        dataset, trainer = datamodule.split_dataset(split), module.trainer
        if datamodule.reference_logps_key(split) == key:  # another module already gave this data these values
            return datamodule.reference_logps(split)
        directory = self._directory(datamodule, split)
        cached = trainer.strategy.broadcast(load_cached(directory, key) if trainer.is_global_zero else None)
        if cached is not None:
            rank_zero_info(
                f"[lit_trainer] {type(module).__name__}: reference log-probs of the {split} data loaded from "
                f"{directory}."
            )
            return cached
        model = self._source(module)
        loader = datamodule.reference_loader(
            split, self.batch_size, num_replicas=trainer.world_size, rank=trainer.global_rank
        )
        was_training = model.training
        model.eval()
        with trainer.precision_plugin.forward_context():
            local = score_pairs(lambda batch: module.score(model, batch).seq, loader, module.device)
        model.train(was_training)
        full = gather_strided(local, len(dataset), trainer.world_size, trainer.strategy.all_gather).cpu()
        if directory is not None and trainer.is_global_zero:
            save_cached(directory, key, full[:, 0], full[:, 1])
        rank_zero_info(
            f"[lit_trainer] {type(module).__name__}: precomputed reference log-probs of the {len(dataset)} {split} "
            "rows."
        )
        return full[:, 0].clone(), full[:, 1].clone()

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """``{split: {"key", "data", "chosen", "rejected"}}``: strings and tensors (``weights_only`` loadable)."""
        return {
            split: {"key": key, "data": data, "chosen": chosen, "rejected": rejected}
            for split, (key, data, chosen, rejected) in self.entries.items()
        }

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Keep a checkpoint's entries; they are used for splits whose data fingerprint still matches."""
        self.restored = dict(state)
