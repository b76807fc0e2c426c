"""The lab: what the command line and the studies train with, above the engine.

The engine (``pipeoptim.Pipeline``, ``pipeoptim.train`` and everything they stand on: the
runtime, the weight policies, the schedules, partitioning, checkpoints) needs torch, numpy and
tqdm only. The lab adds the rest: the tasks with their data sets, tokenisers and metrics
(:mod:`pipeoptim.lab.tasks`, BLEU included), the recipes and the study's advice, optimizers and
learning-rate schedules by name, the experiment runner and its run folders, the planner that
ranks candidates for a task, the plots, and the launcher of torchrun's agent for the command
line. It is installed by the ``lab`` extra (``pip install '.[lab]'`` in the clone); nothing in the
engine imports it (``tests/test_layers.py`` holds that).
"""
