"""The grading framework: what judges a learner's code, knowing nothing of what it teaches.

* ``report``: a check's verdict, item by item (``Report``, ``Report.fail``: one item failed
  and the rest not judged), shown as a table in Jupyter and read by ``dpcourse.grade``.
* ``judging``: a learner's function run on the ranks (``run_or_failure``, ``on_ranks``), a
  failure as data (``RankFailure``), the blanks left in a starter, the clusters a check needs.
* ``registry``: try-its by name (``try_it``) and ``check``, which judges on a second world size
  once an answer passes on the notebook's.
* ``compare``: tensors, lists and dicts of them close to rounding (``close``), and by what
  factor one is another (``scale_of``).
* ``provenance``: which references were read, by any route, in any process of a check.
* ``sandbox``: a learner's formulas run where the course cannot be reached.

The content -- each try-it's and exercise's set-up, items and mistakes, the references, the
sentences on known PyTorch errors -- lives in ``dpcourse.exercises`` and registers itself here.
"""
