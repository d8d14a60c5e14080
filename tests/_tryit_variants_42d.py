"""4.2d's try-its: answers written apart from the references (see _tryit_variants.py)."""

VARIANTS = {}
