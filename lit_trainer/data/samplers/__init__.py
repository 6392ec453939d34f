"""Training samplers: which rows go into each micro-batch, on each rank, in which order.

The contract every training batch sampler satisfies is :class:`BatchSampler` (``batch_sampler.py``; subclass
:class:`EpochPosition` for its resume position), and the data modules' ``sampling`` option is one table from name to
factory (``sampling.py``). One file per sampler: ``random``/``sequential`` (``batch_sampler.py``),
``group_by_length`` (``length_grouped.py``), ``batch_rebalance`` (``rebalance_sampler.py``, with the split of a step
into balanced micro-batches in ``rebalance.py``) and GRPO's prompt order (``repeat_sampler.py``); the per-row lengths
they read and the padding diagnostics are in ``lengths.py``.
"""

from lit_trainer.data.samplers.batch_sampler import BatchSampler, EpochPosition
from lit_trainer.data.samplers.length_grouped import LengthGroupedSampler
from lit_trainer.data.samplers.rebalance_sampler import BatchRebalanceSampler
from lit_trainer.data.samplers.repeat_sampler import RepeatSampler

__all__ = ["BatchRebalanceSampler", "BatchSampler", "EpochPosition", "LengthGroupedSampler", "RepeatSampler"]
