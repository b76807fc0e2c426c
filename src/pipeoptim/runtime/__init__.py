"""Executing schedules: one stage implementation (stage.py) and one executor (executor.py), which
walks each rank's lowered order in one process (local.py) or under torchrun (distributed.py).
The package imports nothing, so that ``runtime.defaults`` is read without torch.
"""
