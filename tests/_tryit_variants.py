"""Answers to the try-it cells written apart from the references: typical mistakes (each must
fail, with the words its report must contain) and correct answers that look different (each
must pass). Each is the reference with text replaced: ``(old, new)`` pairs, every ``old``
found in the reference."""

# name -> {"mistakes": [(label, [(old, new), ...], words in a failed item)],
#          "correct": [(label, [(old, new), ...])]}, one file per chapter
from _tryit_variants_42a import VARIANTS as _42A
from _tryit_variants_42b import VARIANTS as _42B
from _tryit_variants_42c import VARIANTS as _42C
from _tryit_variants_42d import VARIANTS as _42D
from _tryit_variants_42e import VARIANTS as _42E
from _tryit_variants_42f import VARIANTS as _42F
from _tryit_variants_42g import VARIANTS as _42G

VARIANTS = {**_42A, **_42B, **_42C, **_42D, **_42E, **_42F, **_42G}
