"""Reference solutions of the exercises: the starters of the notebooks, filled in.

``dpc.exercises.solution("D")`` prints ``ring_d.py``; ``solution("E")`` prints ``bucketed_e.py``.
The tests run every checker against these files.
"""
