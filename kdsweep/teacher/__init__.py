"""Where the teacher's targets come from, behind one small protocol: a live model, or a teacher-logit cache.

The training step and the evaluation ask a :class:`~kdsweep.teacher.source.TeacherSource` for the targets of each
micro-batch (a :class:`~kdsweep.losses.targets.Targets`) and never see a teacher module. Which source serves which
case (``teacher/job.py:open_teacher`` and ``teacher/mixture.py:mix`` choose; ``teacher/absent.py:for_training``
replaces the training steps' source at ``kd_ratio=0``):

============================  ===================================================  ===================================
case                          source (module)                                      targets it gives
============================  ===================================================  ===================================
live, same tokenizer          ``LiveTeacher`` (live): runs the frozen model        ``Logits`` (logits, or hidden
                                                                                   states + head with loss.impl=fused)
live, another tokenizer       ``CrossTokenizerTeacher`` (cross): the teacher       ``Aligned``, span by span
                              reads each row in its own tokens (reader, views),    (``LiveSpans``: its logits' rows,
                              aligned to the student's (align)                     or hidden states projected by
                                                                                   chunk with loss.impl=fused)
cache, same tokenizer         ``CachedTeacher`` (cached), built once by            ``Logits`` (full), ``Samples``,
                              ``PlainTargets`` (build)                             ``TopK``
cache, another tokenizer      ``CachedCrossTeacher`` (cross_cache), built by       ``Aligned`` (``KeptSpans``: full
                              ``SpanTargets``                                      head logits, or topk / sample
                                                                                   rebuilt, one chunk at a time)
several teachers (any above)  ``MixedTeacher`` (mixture) of each one's source      ``Mixture`` of each one's
kd_ratio=0, training steps    ``TeacherFree`` (absent): no teacher at all          ``NoTargets``
============================  ===================================================  ===================================

A cache memory-maps what one teacher pass wrote beside the tokenization cache (:mod:`kdsweep.teacher.cache`), so a
job that reads it never loads the teacher; the step tells its source which micro-batches come next
(``TeacherSource.prefetch``), and a cache reads each one's fields while the one before it trains.
"""
