"""`python -m pipeoptim` (and `torchrun -m pipeoptim`) runs the command line."""
import sys

from .cli import main

sys.exit(main())
