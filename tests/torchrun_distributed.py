"""Run under torchrun, as the ``equivalence`` script of tests/conftest.py's 4-process job, for
tests/test_distributed.py: its ``_equivalence_worker`` on this process's rank, in a process group
the script starts itself, as a user's would (the Pipelines leave it alone); each rank saves its
results to FOLDER/rankR.pt.

    script FOLDER
"""
import os
import sys

from test_distributed import _equivalence_worker

_equivalence_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, sys.argv[1])
