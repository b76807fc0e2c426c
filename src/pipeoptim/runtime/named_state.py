"""A stage's state keyed by parameter names, to load into another partition.

``torch.optim`` keys optimizer state by a parameter's position, which depends on the partition.
Here every per-parameter entry (optimizer state, the predictor's stored directions, ``ema``'s
averages) is keyed by the parameter's name in the whole model, and every per-group entry
(hyper-parameters, the scheduler's learning rates, the lr of the predictor's last step) by the
name of the group's first parameter. The state is taken at a drained point, where every stage has
applied the same updates, so the weight version and the scheduler's position of any stage hold for all.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .stage import Stage

PER_GROUP_SCHEDULER_KEYS = ("base_lrs", "_last_lr", "lr_lambdas")


def stage_groups(stage: Stage) -> List[List[str]]:
    """The names of the parameters of each of ``stage``'s optimizer groups."""
    # the policy's names: of the parameters the optimizer holds (a sharded module registers
    # gathered copies in their place while it holds them)
    names = {id(p): name for name, p in stage.policy.named}
    return [[names[id(p)] for p in group["params"]] for group in stage.optimizer.param_groups]


def stage_state(stage: Stage) -> Dict[str, Any]:
    """Optimizer, scheduler and policy state of one drained stage, by parameter name."""
    if stage.in_flight:
        raise RuntimeError(f"stage {stage.index} has micro-batches in flight; flush() first")
    groups = stage_groups(stage)
    order = [name for group in groups for name in group]
    torch_state = stage.optimizer.state_dict()
    optimizer = {
        # copies: torch's optimizer state_dict hands out its live tensors, and a load whose
        # tensors already fit keeps them, so without a copy a Pipeline loaded from this state
        # would share momentum buffers with the one that saved it (and see its later updates)
        "state": {order[i]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                  for i, s in torch_state["state"].items()},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": names}
                         for g, names in zip(torch_state["param_groups"], groups)],
    }
    policy = stage.policy.state_dict()
    if "predictor" in policy:
        pred = policy["predictor"]
        policy = {**policy, "predictor": {
            "steps_taken": pred["steps_taken"],
            "stored": {order[int(i)]: t for i, t in pred["stored"].items()},
            "step_lr": {names[0]: lr for names, lr in zip(groups, pred["step_lr"])}}}
    return {"stage": stage.index, "groups": groups, "optimizer": optimizer, "policy": policy,
            "scheduler": stage.scheduler.state_dict() if stage.scheduler is not None else None,
            "counters": dict(stage.record.count),
            # fp16: the loss scale (the same on every stage)
            "loss_scaler": stage.loss_scaling.state_dict() if stage.loss_scaling is not None else None}


def load_stages(stages: Sequence[Stage], saved: Sequence[Dict[str, Any]]) -> None:
    """Load :func:`stage_state` outputs (of any partition of the same model) into ``stages``."""
    owner: Dict[str, Tuple[int, int]] = {}        # parameter name -> (saved stage, group)
    param_state: Dict[str, Any] = {}
    for s, entry in enumerate(saved):
        for g, names in enumerate(entry["groups"]):
            for name in names:
                owner[name] = (s, g)
        param_state.update(entry["optimizer"]["state"])
    taken = set()  # names a stage loaded already: a replica of the same piece gets its own copy
    for stage in stages:
        groups = stage_groups(stage)
        lost = [n for names in groups for n in names if n not in owner]
        if lost:
            raise ValueError(f"stage {stage.index}: the saved state has no parameter {lost[0]}")
        sources = [owner[names[0]] for names in groups]   # each new group's saved group
        state, param_groups, index = {}, [], 0
        for names, (s, g) in zip(groups, sources):
            hyper = {k: v for k, v in saved[s]["optimizer"]["param_groups"][g].items() if k != "params"}
            param_groups.append({**hyper, "params": list(range(index, index + len(names)))})
            for name in names:
                if name in param_state:
                    # (torch keeps a loaded tensor that fits: two optimizers loading one would share it)
                    state[index] = param_state[name] if name not in taken else \
                        {k: v.clone() if torch.is_tensor(v) else v for k, v in param_state[name].items()}
                    taken.add(name)
                index += 1
        stage.optimizer.load_state_dict({"state": state, "param_groups": param_groups})
        first = saved[sources[0][0]]
        if stage.scheduler is not None:
            if first["scheduler"] is None:
                raise ValueError("the saved state has no learning-rate scheduler; this pipeline has one")
            scheduler = copy.copy(first["scheduler"])
            for key in PER_GROUP_SCHEDULER_KEYS:
                if isinstance(scheduler.get(key), list):
                    scheduler[key] = [saved[s]["scheduler"][key][g] for s, g in sources]
            stage.scheduler.load_state_dict(scheduler)
        policy = dict(first["policy"])
        if "predictor" in policy:
            step_lr = {}  # parameter name -> the lr of its group's last step
            for s_entry in saved:
                by_group = s_entry["policy"].get("predictor", {}).get("step_lr", {})
                step_lr.update({name: by_group.get(names[0]) for names in s_entry["groups"] for name in names})
            stored = _gathered(saved, "predictor", "stored")
            order = [name for names in groups for name in names]
            policy["predictor"] = {
                "steps_taken": policy["predictor"]["steps_taken"],
                "stored": {i: stored[name] for i, name in enumerate(order) if name in stored},
                "step_lr": [step_lr.get(names[0]) for names in groups]}
        for section, field in (("ema", "average"), ("error_feedback", "previous")):
            if section in policy:  # keyed by parameter name already: gather every stage's
                policy[section] = {**policy[section], field: _gathered(saved, section, field)}
        stage.policy.load_state_dict(policy)
        if stage.loss_scaling is not None and first.get("loss_scaler") is not None:  # (none: fp32's, bf16's)
            stage.loss_scaling.load_state_dict(first["loss_scaler"])
        if first["stage"] == stage.index and len(saved) == len(stages):
            stage.record.count.update(first["counters"])


def _gathered(saved: Sequence[Dict[str, Any]], section: str, field: str) -> Dict[str, Any]:
    """Every saved stage's ``policy[section][field]`` (keyed by parameter name), in one dict."""
    tensors: Dict[str, Any] = {}
    for entry in saved:
        tensors.update(entry["policy"].get(section, {}).get(field, {}))
    return tensors
