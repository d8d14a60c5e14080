"""Reference solutions of the exercises: the starters of the notebooks, filled in.

``dpc.exercises.solution("A")`` prints ``train_lm_ddp.py`` and ``solution("F")``
``train_lm_fsdp.py``, the conversions of ``starters/train_lm.py`` (a script no chapter
converts); ``solution("D")`` prints ``ring_d.py``, ``solution("E")`` ``bucketed_e.py``.
The tests run every checker against these files.
"""
