"""The method registry: a method is a (schedule, weight policy) pair.

Each :class:`Method`, looked up by name (:func:`get_method`), names the schedule that orders its
work, the weight policy that decides which weights each pass uses, the options a user may set
(by name: each one's default and allowed values are its ``pipeoptim.options.Option``'s), and the number of weight versions stage k holds (docs/architecture.md, "Weight versions per
method"; the simulator reports it, the runtime measures it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .schedules import Schedule, build_schedule
from .schedules.concat import concatenate, repeat
from .schedules.bidirectional import bidirectional_placement, bitpipe_placement
from .schedules.v_shape import v_placement


@dataclass(frozen=True)
class Method:
    name: str
    schedule: str                      #: schedule name in :mod:`pipeoptim.schedules`
    policy: str                        #: class name in :mod:`pipeoptim.weights.policies`
    summary: str
    synchronous: bool
    options: Tuple[str, ...] = ()      #: the method's own options it takes, by name
    default_microbatches: Optional[Callable[[int], int]] = None  #: stages -> M
    versions: Callable[..., int] = lambda k, n, **o: 1  #: weight versions held at stage k of n
    #: model chunks per process by default; above 1 the schedule places several stages on each
    #: rank (docs/architecture.md, "Chunks: several stages per process") and ``chunks=V`` applies
    chunks: int = 1
    #: where stage s of ranks x chunks lives (:meth:`stage_ranks`): "interleaved" (rank s mod N),
    #: "v" (``schedules/v_shape.v_placement``), "bidirectional" or "bitpipe" (``schedules/bidirectional.py``)
    placement: str = "interleaved"
    #: the second half of the stages replicates the first half's model pieces: two pipelines of
    #: the same N pieces (stage N+j a replica of stage j) run in opposite directions, each
    #: replica pair summing its gradients before the update (docs/architecture.md,
    #: "Bidirectional pipelines"); the model is cut into N pieces, not N x chunks
    mirrored: bool = False
    #: a user's own schedule of one mini-batch (``Pipeline(schedule=...)``, :func:`with_order`):
    #: run instead of ``schedule``, once per mini-batch, on its own placement
    order: Optional[Schedule] = None

    def stage_ranks(self, ranks: int, chunks: int) -> List[int]:
        """The rank of each of the ``ranks x chunks`` stages (the schedule's ``stage_to_rank``)."""
        if self.order is not None:
            return list(self.order.stage_to_rank)
        if self.placement == "v":
            return v_placement(ranks)
        if self.placement == "bidirectional":
            return bidirectional_placement(ranks)
        if self.placement == "bitpipe":
            return bitpipe_placement(ranks)
        return [s % ranks for s in range(ranks * chunks)]

    def pieces_per_rank(self, chunks: int) -> int:
        """Model pieces per rank: its chunks, or half of them for a mirrored method (the rest
        are replicas)."""
        return chunks // 2 if self.mirrored else chunks

    def microbatches(self, stages: int, requested: Optional[int]) -> int:
        """Micro-batches per mini-batch (per update) for ``stages`` stages."""
        if requested is not None:
            return requested
        return self.default_microbatches(stages) if self.default_microbatches else 1

    def build_schedule(self, stages: int, microbatches: int, batches: int, *, first_batch: int = 0,
                       options: Optional[Dict[str, Any]] = None, chunks: Optional[int] = None) -> Schedule:
        """The schedule of ``batches`` mini-batches starting at the run's mini-batch number
        ``first_batch``, over ``stages`` ranks (each holding ``chunks`` stages, default the
        method's own: ``stages * chunks`` stages in all). With ``sync_warmup=K`` among
        ``options``, those of the run's first K mini-batches that fall in this span run with 1F1B
        and a flush, before the method's own schedule takes over (two concatenated schedules)."""
        if self.order is not None:
            return repeat(self.order, batches)
        warmup = int((options or {}).get("sync_warmup") or 0)
        sync = min(batches, max(0, warmup - first_batch))
        if not sync:
            return build_schedule(self.schedule, stages, microbatches, batches, chunks=chunks or self.chunks)
        flush = build_schedule("1f1b-flush", stages, microbatches, sync)
        if sync == batches:  # the whole span is warm-up
            return dataclasses.replace(flush, options={**flush.options, "synchronous_updates": sync})
        return concatenate(flush, build_schedule(self.schedule, stages, microbatches, batches - sync),
                           name=f"1f1b-flush+{self.schedule}")

    def weight_versions(self, stages: int, **options: Any) -> List[int]:
        """Per stage, the weight versions (live included) the design table says it holds with
        ``options`` (one not given, or None: its default, which changes no count)."""
        given = {k: v for k, v in options.items() if v is not None}
        return [self.versions(k, stages, **given) for k in range(stages)]


#: The delay corrections (weights/corrections.py has their formulas), all off by default.
#: Every asynchronous method of the async-1F1B schedule takes these: they act on the learning
#: rate and the schedule, not on how weights are chosen.
DELAY_OPTIONS = ("lr_correction", "lr_correction_steps", "sync_warmup")
#: ... and the methods that predict weights take these too: they shape the prediction.
PREDICTION_OPTIONS = ("horizon", "delta", "ema_decay", "prediction_warmup")


def _pipedream_versions(k: int, n: int, vertical_sync: bool = False, **_: Any) -> int:
    return n if vertical_sync else n - k


def _ema(delta: str) -> int:
    return 1 if delta == "ema" else 0


def _pipeoptim_versions(k: int, n: int, backward: str = "latest", delta: str = "optimizer", steps: str = "exact",
                        **_: Any) -> int:
    # latest: the live weights and one cache. predicted: each in-flight mini-batch keeps its own
    # predicted copy for its backward, up to N-1-k of them beside the live weights and cache.
    # delta="ema": one more buffer, the average of the updates. The last stage predicts over
    # s = 0 updates (exact and paper; the authors' code counts N-k = 1): the live weights alone.
    if k == n - 1 and steps != "code":
        return 1
    return (2 if backward == "latest" else 2 + (n - 1 - k)) + _ema(delta)


def _feedback(error_feedback: bool) -> int:
    # error_feedback=True: the previous update and the scratch copy of the weights
    return 2 if error_feedback else 0


def _pipeoptim_2bw_versions(k: int, n: int, error_feedback: bool = False, **_: Any) -> int:
    # stages 0..N-2: the live weights and the predicted values of two windows in flight at once
    # (the next window starts before the last backwards of the current one); the last stage runs
    # each window on its live weights (s = 0), no update inside a window: nothing kept.
    return (1 if k == n - 1 else 3) + _feedback(error_feedback)


#: Error feedback (weights/error_feedback.py) for the methods whose every update is one update
#: stale (2BW's schedule); off by default.
FEEDBACK_OPTIONS = ("error_feedback",)


METHODS: Dict[str, Method] = {m.name: m for m in [
    Method("sequential", "gpipe", "SynchronousPolicy",
           "no pipeline: the whole model as one stage (the reference)", True),
    Method("gpipe", "gpipe", "SynchronousPolicy",
           "all forwards, all backwards, one update per mini-batch (GPipe)", True,
           default_microbatches=lambda n: n),
    Method("1f1b-flush", "1f1b-flush", "SynchronousPolicy",
           "1F1B with a flush before each update (DAPPLE, PipeDream-Flush)", True,
           default_microbatches=lambda n: n),
    Method("zb-h1", "zb-h1", "SynchronousPolicy",
           "1F1B with a flush, the backward split: weight gradients fill the bubble (zero bubble H1)", True,
           default_microbatches=lambda n: n),
    Method("interleaved", "interleaved-1f1b", "SynchronousPolicy",
           "1F1B over V model chunks per process (stage k holds chunks k, k + N, ...), a flush "
           "before each update (Megatron-LM's interleaved 1F1B)", True,
           default_microbatches=lambda n: n, chunks=2),
    Method("zb-v", "zb-v", "SynchronousPolicy",
           "two chunks per process in a V (stage k holds chunks k and 2N-1-k), backward split into "
           "input and weight halves, a flush before each update (zero bubble V)", True,
           default_microbatches=lambda n: n, chunks=2, placement="v"),
    Method("dualpipev", "dualpipev", "SynchronousPolicy",
           "two chunks per process in a V (as zb-v), the forward of one micro-batch paired with the backward "
           "of another (OVERLAP_F_B, run one after the other on the CPU), a flush before each update "
           "(DeepSeek's DualPipeV, as torch's ScheduleDualPipeV orders it)", True,
           default_microbatches=lambda n: 2 * n, chunks=2, placement="v"),
    Method("bidirectional", "bidirectional", "SynchronousPolicy",
           "two pipelines of the same pieces in opposite directions, half the micro-batches each, every "
           "process holding a stage of each; the two replicas of a piece sum their gradients before the "
           "update (Chimera's shape; one pipeline, no data parallel on top yet)", True, default_microbatches=lambda n: n + n % 2, chunks=2,
           placement="bidirectional", mirrored=True),
    Method("bitpipe", "bitpipe", "SynchronousPolicy",
           "two V-shaped pipelines of the same 2N pieces in opposite directions, half the micro-batches "
           "each, every process holding two stages of each, each V's turn a hand-off in memory; the two "
           "replicas of a piece sum their gradients before the update (BitPipe; no data parallel on top "
           "yet)", True, default_microbatches=lambda n: n + n % 2, chunks=4, placement="bitpipe",
           mirrored=True),
    Method("async-naive", "async-1f1b", "LatestPolicy",
           "asynchronous 1F1B on whatever weights are live (stale, inconsistent)", False,
           options=DELAY_OPTIONS),
    Method("pipedream", "async-1f1b", "StashingPolicy",
           "asynchronous 1F1B with weight stashing (PipeDream)", False,
           options=("vertical_sync", *DELAY_OPTIONS),
           versions=_pipedream_versions),
    Method("pipedream-2bw", "2bw", "DoubleBufferPolicy",
           "async 1F1B over micro-batches, an update every m >= N, two buffers (PipeDream-2BW)", False,
           options=FEEDBACK_OPTIONS, default_microbatches=lambda n: n,
           versions=lambda k, n, error_feedback=False, **o: (1 if n == 1 else 2) + _feedback(error_feedback)),
    Method("pipeoptim-2bw", "2bw", "PipeOptim2BWPolicy",
           "2BW's schedule and windows, each window on weights predicted over the updates it misses", False,
           options=(*FEEDBACK_OPTIONS, "predict_feedback"), default_microbatches=lambda n: n,
           versions=_pipeoptim_2bw_versions),
    Method("spectrain", "async-1f1b", "SpecTrainPolicy",
           "momentum-based prediction in both passes (SpecTrain)", False,
           options=(*DELAY_OPTIONS, *PREDICTION_OPTIONS),
           versions=lambda k, n, delta="optimizer", **o: (2 + _ema(delta)) if (k // 2 + n - k - 1) or k // 2 else 1),
    Method("xpipe", "async-1f1b", "XPipePolicy",
           "micro-batched async pipeline with Adam-direction prediction (XPipe)", False,
           options=(*DELAY_OPTIONS, *PREDICTION_OPTIONS),
           default_microbatches=lambda n: 2, versions=lambda k, n, delta="optimizer", **o: 2 + _ema(delta)),
    Method("pipeoptim", "async-1f1b", "PipeOptimPolicy",
           "async 1F1B, forwards on optimizer-dependent predicted weights (PipeOptim)", False,
           options=("steps", "backward", "sgd_momentum", *DELAY_OPTIONS, *PREDICTION_OPTIONS),
           versions=_pipeoptim_versions),
]}


def with_order(method: Method, order: Schedule) -> Method:
    """``method`` (synchronous: its weight policy) running ``order``, one mini-batch's schedule
    checked by ``schedules.custom.check_order``: its placement, chunks and micro-batches."""
    m = order.microbatches_per_update
    return dataclasses.replace(method, order=order, chunks=order.num_stages // order.num_ranks,
                               placement="custom", default_microbatches=lambda n: m)


def method_names() -> List[str]:
    return list(METHODS)


def clip_scope_for(method: Method, clip_scope: str) -> str:
    """``clip_scope`` with ``auto`` resolved: ``global`` for a synchronous method with one copy of
    each stage (it then clips as the plain loop's ``clip_grad_norm_`` over the whole model),
    ``stage`` otherwise (``pipeoptim.options``, ``clip_scope``)."""
    if clip_scope != "auto":
        return clip_scope
    return "global" if method.synchronous and not method.mirrored else "stage"


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[name]


#: A candidate the planner may name beside the plain methods: a method with error feedback on,
#: written as the study writes it (``pipeoptim-2bw+ef`` is pipeoptim-2bw with error_feedback=True),
#: and, for a method whose prediction can know the feedback, ``+ef+aware`` (predict_feedback=True too).
FEEDBACK_SUFFIX = "+ef"
AWARE_SUFFIX = "+aware"


def split_variant(name: str) -> Tuple[str, Dict[str, Any]]:
    """``(method, options)`` of a variant name: a method's name (no options), or a method that
    offers error feedback with :data:`FEEDBACK_SUFFIX` (``{"error_feedback": True}``), then
    :data:`AWARE_SUFFIX` where its prediction offers ``predict_feedback`` (that option True too).
    Anything else is a ValueError naming the choices."""
    aware = name.endswith(FEEDBACK_SUFFIX + AWARE_SUFFIX)
    if aware or name.endswith(FEEDBACK_SUFFIX):
        base = name[:-len(FEEDBACK_SUFFIX + (AWARE_SUFFIX if aware else ""))]
        offers = "predict_feedback" if aware else "error_feedback"
        if base in METHODS and offers in METHODS[base].options:
            return base, {"error_feedback": True, **({"predict_feedback": True} if aware else {})}
        said = f"{FEEDBACK_SUFFIX}{AWARE_SUFFIX} (error feedback, the prediction aware of it)" if aware \
            else f"{FEEDBACK_SUFFIX} (error feedback)"
        raise ValueError(f"unknown variant {name!r}: {said} applies to "
                         f"{', '.join(v for v in feedback_variants() if v.endswith(AWARE_SUFFIX) == aware)}")
    get_method(name)
    return name, {}


def variant_name(method: str, options: Dict[str, Any]) -> str:
    """The name :func:`split_variant` reads back: ``method``, with :data:`FEEDBACK_SUFFIX` where
    ``options`` turn error feedback on, and :data:`AWARE_SUFFIX` after it where they turn
    ``predict_feedback`` on too."""
    if not options.get("error_feedback"):
        return method
    return method + FEEDBACK_SUFFIX + (AWARE_SUFFIX if options.get("predict_feedback") else "")


def feedback_variants() -> List[str]:
    """The variant names with error feedback: one per method that offers it, and its ``+aware``
    one where the method's prediction offers ``predict_feedback``."""
    return [name + suffix for name, m in METHODS.items()
            for suffix, option in ((FEEDBACK_SUFFIX, "error_feedback"), (FEEDBACK_SUFFIX + AWARE_SUFFIX,
                                                                        "predict_feedback"))
            if option in m.options]
