import os
import sys

PARENT = os.getppid()  # before anything slow: torchrun's agent, whose death this process follows

from .runner import main  # noqa: E402 -- imports torch

sys.exit(main(parent=PARENT))
