# Loaded by Python at start-up in the processes a checker starts (it puts this folder first on
# PYTHONPATH): in torchrun's workers it records what the learner's script does, for the checker.
import os

if os.environ.get("DPCOURSE_OBSERVE_DIR") and "RANK" in os.environ:
    from dpcourse.exercises.observe import install

    install(os.environ["DPCOURSE_OBSERVE_DIR"], int(os.environ["RANK"]))
