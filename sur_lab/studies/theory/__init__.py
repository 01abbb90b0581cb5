"""The theory behind budgeted repair, made measurable (notebook 01).

* :mod:`~sur_lab.studies.theory.bound`: Proposition 14.1 (appendix 14, Eq. 25-28) on tensors
  (:func:`mixed_cache_bound`) and the tables of its terms (:func:`bound_summary`, :func:`eq28_table`).
* :mod:`~sur_lab.studies.theory.capture`: Proposition 14.1 on a real model (query and attention-output capture,
  :func:`bound_study`), and the real-context case (:func:`theory_edit`).
* :mod:`~sur_lab.studies.theory.cost`: the cost model of budgeted recomputation (appendix 13.1, Eq. 15-19) and the
  traversal-overhead fit (:func:`fit_traversal_model`).
"""

from sur_lab.studies.theory import bound, capture, cost
from sur_lab.studies.theory.bound import *  # noqa: F403
from sur_lab.studies.theory.capture import *  # noqa: F403
from sur_lab.studies.theory.cost import *  # noqa: F403

__all__ = [*bound.__all__, *capture.__all__, *cost.__all__]
