"""The equal-time study's harness: the studies' plans and runners, the budgets they are priced
from, and the report generators that write docs/results.md, docs/results-v1.md and the package's
table of the study's conclusions (src/pipeoptim/lab/tasks/equal_time_study.json). Every module runs
from the repository root as ``python -m study.<name>``; the rows are in ``study/results/``."""
