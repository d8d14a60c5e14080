"""The pool's code that runs in each rank's process (see ``dpcourse.pool``)."""
