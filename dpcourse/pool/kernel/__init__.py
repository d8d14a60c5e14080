"""The pool's code that runs in the notebook's kernel (see ``dpcourse.pool``)."""
