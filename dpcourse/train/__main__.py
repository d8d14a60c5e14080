import os

PARENT = os.getppid()  # before anything slow: torchrun's agent, whose death this process follows

from ..processes import exit_without_shutdown  # noqa: E402
from .runner import main  # noqa: E402 -- imports torch

# Leave without Python's shutdown, where Gloo's worker threads can abort the finished process
# (see dpcourse/processes.py). Every file the runner wrote is closed.
exit_without_shutdown(main(parent=PARENT))
