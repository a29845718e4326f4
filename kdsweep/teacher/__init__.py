"""Where the teacher's targets come from, behind one small protocol: a live model, or a teacher-logit cache.

The training step and the evaluation ask a :class:`~kdsweep.teacher.source.TeacherSource` for the targets of each micro-batch
(:mod:`kdsweep.losses.targets`) and never see a teacher module. :class:`~kdsweep.teacher.live.LiveTeacher` runs the
frozen model; :class:`~kdsweep.teacher.cached.CachedTeacher` memory-maps what one teacher pass wrote beside the
tokenization cache (:mod:`kdsweep.teacher.cache`), so a job that reads it never loads the teacher;
:class:`~kdsweep.teacher.cross.CrossTokenizerTeacher` runs a teacher with another tokenizer on its own reading of
each row (:mod:`kdsweep.teacher.reader`; chat rows in its own template: :mod:`kdsweep.teacher.views`) and gives
its targets on the student's positions, span by span (:mod:`kdsweep.teacher.align`).
"""
