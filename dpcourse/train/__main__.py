import os
import sys

PARENT = os.getppid()  # before anything slow: torchrun's agent, whose death this process follows

from .runner import main  # noqa: E402 -- imports torch

code = main(parent=PARENT)
# Leave without Python's shutdown: after destroy_process_group() Gloo's worker threads are
# still there (a wrapped model keeps the group alive), and one that needs the GIL while the
# interpreter finalizes aborts the finished process (SIGABRT), which torchrun reports as a
# failure. Every file the runner wrote is closed; only the streams need flushing.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
