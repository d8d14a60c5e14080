"""4.2e's try-its: answers written apart from the references (see _tryit_variants.py)."""

VARIANTS = {}
