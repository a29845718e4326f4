"""Packed trials: several trials of a sweep trained in one job, over one frozen student base and one teacher pass.

A pack's members differ only in per-trial knobs (``kd_ratio``, the learning rate, the LoRA's rank and alpha, the
divergence and its temperature and β); each still trains exactly as it would alone. What they share: the student's
frozen base weights, held once (:mod:`kdsweep.pack.members`), and each micro-batch's teacher targets, made once per
step for every member that reads them (:func:`kdsweep.train.step.train_step` over several
:class:`~kdsweep.train.step.Learner`\\ s). A packed job (:mod:`kdsweep.pack.job`) steps the members' runs together,
each its own trial in every record it writes.
"""

from kdsweep.pack.job import check_pack, run_pack
from kdsweep.pack.members import OverOneBase, shares_base, students_over_one_base

__all__ = ["OverOneBase", "check_pack", "run_pack", "shares_base", "students_over_one_base"]
