"""Reference-free preference optimisation, as imported before the modules moved to their own files:
:class:`~lit_trainer.modules.orpo.ORPOModule` (``orpo.py``), :class:`~lit_trainer.modules.cpo.CPOModule`
(``cpo.py``) and TRL's metric names of each (their base is in ``_reference_free.py``)."""

from lit_trainer.modules._reference_free import CPO_METRIC_NAMES, ORPO_METRIC_NAMES
from lit_trainer.modules.cpo import CPOModule
from lit_trainer.modules.orpo import ORPOModule

__all__ = ["CPO_METRIC_NAMES", "ORPO_METRIC_NAMES", "CPOModule", "ORPOModule"]
