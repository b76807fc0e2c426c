"""The method registry: a training method is a (schedule, weight policy) pair, looked up by name.

Each :class:`Method` names the schedule that orders its work, the weight policy that decides
which weights each pass uses, the options a user may set, and the number of weight versions
DESIGN.md section 4 says stage k holds (the simulator reports it; the runtime measures it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from .schedules import Schedule, build_schedule


@dataclass(frozen=True)
class Method:
    name: str
    schedule: str                      #: schedule name in :mod:`pipeoptim.schedules`
    policy: str                        #: class name in :mod:`pipeoptim.weights.policies`
    summary: str
    synchronous: bool
    options: Dict[str, Any] = field(default_factory=dict)   #: option -> default
    choices: Dict[str, tuple] = field(default_factory=dict)  #: option -> allowed values
    default_microbatches: Optional[Callable[[int], int]] = None  #: stages -> M
    versions: Callable[..., int] = lambda k, n, **o: 1  #: weight versions held at stage k of n

    def microbatches(self, stages: int, requested: Optional[int]) -> int:
        """Micro-batches per mini-batch (per update) for ``stages`` stages."""
        if requested is not None:
            return requested
        return self.default_microbatches(stages) if self.default_microbatches else 1

    def build_schedule(self, stages: int, microbatches: int, batches: int) -> Schedule:
        return build_schedule(self.schedule, stages, microbatches, batches)

    def weight_versions(self, stages: int, **options: Any) -> List[int]:
        """Per stage, the weight versions (live included) the design table says it holds."""
        merged = {**self.options, **{k: v for k, v in options.items() if v is not None}}
        return [self.versions(k, stages, **merged) for k in range(stages)]

    def resolve_options(self, given: Dict[str, Any]) -> Dict[str, Any]:
        """Defaults overlaid with ``given``; unknown options and bad values raise ValueError."""
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            allowed = ", ".join(self.options) or "none"
            raise ValueError(f"method {self.name!r} takes no option {', '.join(unknown)} "
                             f"(its options: {allowed})")
        merged = {**self.options, **given}
        for key, allowed in self.choices.items():
            if merged[key] not in allowed:
                raise ValueError(f"{self.name}: {key} must be one of {', '.join(map(str, allowed))}, "
                                 f"got {merged[key]!r}")
        return merged


def _pipedream_versions(k: int, n: int, vertical_sync: bool = False, **_: Any) -> int:
    return n if vertical_sync else n - k


def _pipeoptim_versions(k: int, n: int, backward: str = "latest", **_: Any) -> int:
    # latest: the live weights and one cache. predicted: each in-flight mini-batch keeps its own
    # predicted copy for its backward, up to N-1-k of them beside the live weights and cache.
    return 2 if backward == "latest" else 2 + (n - 1 - k)


METHODS: Dict[str, Method] = {m.name: m for m in [
    Method("sequential", "gpipe", "SynchronousPolicy",
           "no pipeline: the whole model as one stage (the reference)", True),
    Method("gpipe", "gpipe", "SynchronousPolicy",
           "all forwards, all backwards, one update per mini-batch (GPipe)", True,
           default_microbatches=lambda n: n),
    Method("1f1b-flush", "1f1b-flush", "SynchronousPolicy",
           "1F1B with a flush before each update (DAPPLE, PipeDream-Flush)", True,
           default_microbatches=lambda n: n),
    Method("async-naive", "async-1f1b", "LatestPolicy",
           "asynchronous 1F1B on whatever weights are live (stale, inconsistent)", False),
    Method("pipedream", "async-1f1b", "StashingPolicy",
           "asynchronous 1F1B with weight stashing (PipeDream)", False,
           options={"vertical_sync": False}, choices={"vertical_sync": (False, True)},
           versions=_pipedream_versions),
    Method("pipedream-2bw", "2bw", "DoubleBufferPolicy",
           "async 1F1B over micro-batches, an update every m >= N, two buffers (PipeDream-2BW)", False,
           default_microbatches=lambda n: n, versions=lambda k, n, **o: 1 if n == 1 else 2),
    Method("spectrain", "async-1f1b", "SpecTrainPolicy",
           "momentum-based prediction in both passes (SpecTrain)", False,
           versions=lambda k, n, **o: 2 if (k // 2 + n - k - 1) or k // 2 else 1),
    Method("xpipe", "async-1f1b", "XPipePolicy",
           "micro-batched async pipeline with Adam-direction prediction (XPipe)", False,
           default_microbatches=lambda n: 2, versions=lambda k, n, **o: 2),
    Method("pipeoptim", "async-1f1b", "PipeOptimPolicy",
           "async 1F1B, forwards on optimizer-dependent predicted weights (PipeOptim)", False,
           options={"steps": "exact", "backward": "latest", "sgd_momentum": "paper"},
           choices={"steps": ("exact", "paper", "code"), "backward": ("latest", "predicted"),
                    "sgd_momentum": ("paper", "code")},
           versions=_pipeoptim_versions),
]}


def method_names() -> List[str]:
    return list(METHODS)


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[name]
