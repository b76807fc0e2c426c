"""Every option of a pipeline run, defined once: its name, type, default, meaning, and how the
command line takes it.

An :class:`Option` is a keyword of :class:`pipeoptim.Pipeline` (``scope="pipeline"``), of
:meth:`pipeoptim.Pipeline.fit` (``"fit"``), or a method's own option (``"method"``: passed to
the Pipeline as a keyword and to the method's weight policy; which methods take it is read from
the method registry, :func:`takers`). :func:`pipeoptim.train` takes them all. The configuration
objects are made from this table (:mod:`pipeoptim.config`: a field per option, of its type and
default), and so are the signatures and docstrings of ``Pipeline``, ``fit`` and ``train``
(:func:`describe`), the command line's flags and ``--help`` (``pipeoptim.cli.flags``) and the
names of the run folder's record (``pipeoptim.lab.config``); ``tests/test_options.py`` fails
where an option reaches one of them and not another. Imports no torch, so that
``pipeoptim --help`` starts without it.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .methods import method_names
from .runtime.defaults import CLIP_SCOPES, COMPILE_BACKENDS as BACKENDS, DEFAULT_METHOD, DEFAULT_TIMEOUT, PRECISIONS

#: The default of an option that must be given (the Pipeline's optimizer).
REQUIRED = object()

#: A flag's default where the command line passes None on: the task's recipe, the method or the
#: run decides (or, for ``--resume``, no run to resume).
NOT_GIVEN = object()


@dataclass(frozen=True)
class Flag:
    """How the command line takes an option: ``--name-with-dashes`` unless ``name`` says another,
    parsed by ``type`` (a name the command line resolves: ``int``, ``float``, ``str``, ``ints``
    for comma-separated integers, ``norm`` for a max norm or none, ``path``; or ``switch`` for a
    flag without a value), in the ``--help`` group ``group``. ``config``: the name the command
    line's record of a run gives it (the parsed flag, the run folder's ``config.json``), where it
    differs from the option's (``--clip-grad``: ``clip_grad``). ``default``: the command line's
    own default where it differs from the API's (``NOT_GIVEN``: None, and the task's recipe, the
    method or the run decides). ``note``: what ``--help`` adds (the command line's form of the
    value). ``help``: the meaning in the command line's words, where the
    option's own speaks of Python (a bool, a list, a keyword): ``--help`` prints it instead.
    ``const``: the value of the flag given without one (its value is then optional)."""

    type: str = "str"
    group: str = "pipeline"
    name: Optional[str] = None
    metavar: Optional[str] = None
    choices: Optional[Tuple[Any, ...]] = None
    config: Optional[str] = None
    default: Any = None
    note: str = ""
    #: set by the command that has it (``train`` or ``compare`` alone, or the distributed runtime's options)
    only: Optional[str] = None
    #: held in the run's record, the lab's RunConfig (False: the command passes it to the run apart)
    in_config: bool = True
    help: str = ""
    const: Any = None

    def flag_name(self, option: str) -> str:
        return self.name or "--" + option.replace("_", "-")


@dataclass(frozen=True)
class Option:
    """One option: ``name`` (the keyword), ``annotation`` (its type, as a typing expression over
    :mod:`typing`'s names: the configuration's field has it), ``default`` (the API's), ``help``
    (what it means, as the docstrings and ``--help`` say it), ``scope`` (``pipeline``, ``fit`` or
    ``method``), and ``flag``: how the command line takes it, or None with ``api_only`` saying
    why it has none (a Python object, or not yet). ``choices``: a method's option's allowed values
    (None: any of its type; ``pipeoptim.checks`` refuses another, the flags offer them)."""

    name: str
    annotation: str
    default: Any
    help: str
    scope: str
    flag: Optional[Flag] = None
    api_only: str = ""
    choices: Optional[Tuple[Any, ...]] = None


CORRECTIONS = "delay corrections (asynchronous methods; all off by default)"

OPTIONS: Tuple[Option, ...] = (
    # -- the Pipeline: the method, the cut, the devices -------------------------------------
    Option("method", "str", DEFAULT_METHOD,
           "the training method: a (schedule, weight policy) pair from the registry, "
           "by name (pipeoptim.method_names()). The default, zb-h1, is a synchronous zero-bubble pipeline: it "
           "trains exactly as the plain loop's step on each whole mini-batch, and the study "
           "found a synchronous pipeline gives the better model in the same time on three of its four tasks; "
           "the asynchronous methods (pipeoptim, pipeoptim-2bw, ...) trade that equality for fewer bubbles",
           "pipeline", Flag(group="method", only="train", choices=tuple(method_names()),
                            note="`pipeoptim compare` takes --methods, comma-separated")),
    Option("loss_fn", "Optional[Callable[..., Any]]", None,
           "loss_fn(output, target) -> scalar tensor, a mean over the mini-batch, of the output "
           "as the model returns it (a tensor, a tuple, a dict, a ModelOutput). A mini-batch is (inputs, target) "
           "(inputs: a tensor, a tuple of positional or a dict of keyword arguments), or a dict of keyword "
           "tensors (each split along dim 0) whose labels is the target (model(**rest)). None: the model "
           "computes its own loss, model(**batch).loss (or ['loss']), from dict batches with labels, which "
           "reach the last stage as a target does and every earlier stage that reads them (an encoder-decoder "
           "shifting them into its decoder's input); other forms are refused with the fix (pipeoptim.batches)",
           "pipeline", api_only="a function; the command line takes the task's"),
    Option("loss_normalization", "Union[str, Callable[..., Any]]", "items",
           "how a mini-batch's loss weighs its micro-batches (and replicas): items (every real item weighed "
           "once: each micro-batch's mean loss by its share of the step's items, so that a synchronous method "
           "equals the step on the whole mini-batch even when micro-batches hold different numbers of real "
           "tokens; an item is an entry of an integer target or labels other than -100, not counting each "
           "row's first label where a transformers causal LM predicts the next token, or a row of any other "
           "target); rows (each micro-batch's mean by its share of the samples: gradient accumulation of "
           "the micro-batch means, as pipeoptim weighed them before, and the right weights for a loss_fn that "
           "averages per sample first); or "
           "fn(target) -> int, the items of a target as the loss_fn's mean counts them (a loss_fn that "
           "ignores another index). The loss reported is the same weighted mean", "pipeline",
           api_only="the command line's tasks' losses are means over rows of one width, which items and rows "
                    "weigh alike"),
    Option("optimizer", "Callable[..., Any]", REQUIRED,
           "optimizer(params) -> torch.optim.Optimizer, called once per stage with that "
           "stage's parameters", "pipeline", api_only="a factory; the command line builds one from --optimizer "
           "and --lr (the lab's options)"),
    Option("stages", "Optional[int]", None,
           "the pipeline's depth N: its ranks, each holding one stage, or chunks stages (a process each "
           "under torchrun; default there: the processes of a replica); the model is cut by the "
           "partitioner into N x chunks stages", "pipeline",
           Flag("int", default=NOT_GIVEN, help="the pipeline's depth N: its ranks (one process each with --runtime "
                "distributed), each holding one stage or --chunks stages, cut by --partitioner", note="default: the --partition's, else 4; sequential uses 1")),
    Option("partition", "Optional[Sequence[int]]", None,
           "layers per stage of an nn.Sequential (units per stage of a traced model), "
           "e.g. [3, 3, 2]; with chunks, the layers of every one of the stages x chunks pieces", "pipeline",
           Flag("ints", metavar="N,N,...", help="layers per stage of the model, e.g. 3,3,2 (a traced model: units "
                "per stage); with --chunks, the layers of every one of the stages x chunks pieces")),
    Option("partitioner", "str", "uniform", "how stages=N is cut: uniform (the same number of layers, or of a traced "
           "model's units that hold parameters, per stage), params (balanced parameter counts), both a function "
           "of the model alone, the same in every launcher and run; or time (opt-in: balanced by each layer's "
           "forward+backward time profiled on the example input, which differs between runs and machines; "
           "under torchrun rank 0's; the cut it chose is printed, to be given again as partition= or "
           "split_points=)", "pipeline",
           Flag(choices=("uniform", "params"), default="uniform",
                help="how --stages cuts the model: uniform (the same number of layers per stage) or params "
                     "(balanced parameter counts), both a function of the model alone, the same in every "
                     "launcher and run; `pipeoptim plan` balances profiled times and writes the cut it "
                     "chose into its plan file")),
    Option("split_points", "Optional[Sequence[str]]", None,
           "a traced model's cut: the qualified names of the submodules where stages "
           "2..N begin (['layers.4', 'layers.8']), in call order; for a method with several pieces per stage, "
           "where pieces 2..N x pieces begin", "pipeline",
           api_only="the command line's models are cut by --stages/--partition"),
    Option("example_input", "Any", None, "the inputs to trace a model that is not an nn.Sequential on (a tensor, a "
           "tuple of the forward's positional arguments, or a dict batch); default: the first mini-batch, "
           "and the model is split then", "pipeline", api_only="a tensor; the command line traces on its data"),
    Option("chunks", "Optional[int]", None,
           "stages (model chunks) per rank, for interleaved (default 2): the model is cut into "
           "N x chunks stages and rank r holds stages r, r + N, ... (Megatron's placement; it needs at "
           "least that many layers and micro-batches a multiple of N); zb-v and dualpipev always "
           "hold 2, in a V (stages r and 2N-1-r)", "pipeline",
           Flag("int", help="stages (model chunks) per rank, for interleaved (default 2): the model is cut into "
                "N x chunks stages and rank r holds stages r, r + N, ... (Megatron's placement; it needs at "
                "least that many layers, and --micro-batches a multiple of N); zb-v and dualpipev always "
                "hold 2, in a V (stages r and 2N-1-r)")),
    Option("schedule", "Any", None,
           "a schedule of one's own, run instead of the method's: a pipeoptim.schedules.Schedule of one "
           "mini-batch (one update per stage), or the path of torch's compute-only CSV (one row per rank, "
           "torch's actions: 0F1, 1B0, 0I2, 0W2, (0F7;7B3)OVERLAP_F_B; the updates go after each stage's last "
           "backward). The stages and their ranks, chunks and micro-batches are the schedule's; the weights "
           "are the method's, which must be synchronous (default zb-h1's: equal to sequential training). It "
           "is checked before any work (a stage on one rank, every forward before its backward, no deadlock "
           "under the simulator; a refusal names the action) and runs once per mini-batch", "pipeline",
           api_only="a Schedule or a file; `pipeoptim schedule --from-csv FILE` simulates and draws one"),
    Option("micro_batches", "Optional[int]", None,
           "micro-batches per mini-batch for the methods that use them (default: the "
           "method's own: N for gpipe, 1f1b-flush, zb-h1, interleaved, zb-v and the 2BW methods, 2N for dualpipev, 2 for xpipe, "
           "1 for the others)", "pipeline", Flag("int")),
    Option("lr_scheduler", "Optional[Callable[..., Any]]", None,
           "lr_scheduler(optimizer) -> LRScheduler, called once per stage; each stage "
           "steps it right after its own update, so update j has the same lr on every stage whatever the "
           "method, and the prediction reads the group's lr as it is then", "pipeline",
           api_only="a factory; the command line builds one from --lr-schedule"),
    Option("clip_grad_norm", "Optional[float]", None,
           "clip the gradient norm to this before every update (see clip_scope)",
           "pipeline", Flag("norm", group="optimizer", name="--clip-grad", metavar="MAX_NORM", config="clip_grad",
                            default=NOT_GIVEN, help="clip the gradient norm to MAX_NORM before every update (see "
                            "--clip-scope)", note="none: no clipping (default: the task's recipe)")),
    Option("clip_scope", "str", "auto", "global: clip by the norm over all stages, as a plain loop's "
           "clip_grad_norm_ clips the whole model (as torchtitan does), for synchronous methods only: an "
           "asynchronous stage never holds the same mini-batch's gradients as the others when it updates; "
           "stage: each stage clips by its own gradient's norm; auto: global where the method allows it (the "
           "synchronous methods with one copy of each stage, so that they equal the plain loop), stage for the "
           "others (the asynchronous methods, and bidirectional and bitpipe, whose two replicas of each piece a "
           "global norm would count twice)",
           "pipeline", Flag(choices=CLIP_SCOPES, group="optimizer")),
    Option("precision", "str", "fp32", "fp32, bf16 or fp16: forwards and backwards under torch.autocast on each "
           "stage's device; parameters, gradients, optimizer state, prediction and every weight version stay fp32. "
           "fp16 scales the loss as torch.amp.GradScaler does (its defaults: the scale starts at 2**16, halves at "
           "an update whose gradients hold an inf or nan, doubles after 2000 updates without one), one scale for "
           "every stage and replica: an inf or nan in any stage's gradients skips the update on every stage "
           "(no optimizer or scheduler step, the weight version stays); gradients are unscaled before clipping; "
           "the scale is checkpointed. Refused for the asynchronous methods under torchrun (each stage would "
           "wait at every update for the first stage's backward of that mini-batch): in one process they run",
           "pipeline",
           Flag(choices=PRECISIONS, group="precision and devices")),
    Option("recompute", "Union[bool, Sequence[bool]]", False,
           "activation recomputation (True for every stage, or one bool per stage): a "
           "recomputing stage keeps only its input per micro-batch in flight and runs its forward again in "
           "the backward (torch's non-reentrant checkpointing), on the forward's random state and weights, so the losses equal those without it; "
           "where a method's weights change between a forward and its backward without a copy kept "
           "(async-naive, pipeoptim with backward=latest, spectrain, xpipe), it keeps a copy of the forward's "
           "weights per micro-batch in flight instead", "pipeline",
           Flag("switch", group="precision and devices",
                help="activation recomputation on every stage: a stage keeps only its input per micro-batch in "
                "flight and runs its forward again in the backward (torch's non-reentrant checkpointing), on the "
                "forward's random state and weights, so the losses equal those without it; where a method's "
                "weights change between a forward and its backward without a copy kept (async-naive, pipeoptim "
                "with --backward latest, spectrain, xpipe), it keeps a copy of the forward's weights per "
                "micro-batch in flight instead")),
    Option("compile", "Union[bool, str]", False,
           "run each stage's forward through torch.compile (True: the inductor backend, or "
           "a backend's name: aot_eager, eager), for every method: the weight version of each pass is a "
           "graph input, so swapping versions recompiles nothing; a mini-batch of another size recompiles "
           "once, with that dimension dynamic after it; metrics['compilations'] counts each stage's graphs. "
           "On the CPU inductor needs a C++ compiler and Python's headers. A compiled backward is one "
           "graph: zb-h1 and zb-v compute both halves' gradients in the input half", "pipeline",
           Flag(metavar="BACKEND", choices=BACKENDS, group="precision and devices", const=BACKENDS[0],
                help="run each stage's forward through torch.compile, for every method: --compile alone uses "
                "inductor (torch's default), or name the backend: aot_eager, eager; the weight version of each "
                "pass is a graph input, so swapping versions recompiles nothing; a mini-batch of another size "
                "recompiles once, with that dimension dynamic after it; the summary counts each stage's graphs "
                "(compilations). On the CPU inductor needs a C++ compiler and Python's headers. A compiled "
                "backward is one graph: zb-h1 and zb-v compute both halves' gradients in the input half")),
    Option("devices", "Any", "auto", "auto (one GPU per stage when there are enough, else the CPU), one device for "
           "every stage, or one per stage (pipeline.resolve_devices); inputs go to the first stage's device, "
           "targets to the last's, activations and gradients between the stages' devices",
           "pipeline", Flag(name="--device", metavar="DEV", group="precision and devices", config="device",
                            help="auto (one GPU per stage when there are enough, else the CPU), one device for "
                            "every stage (cpu, cuda, cuda:1), or one per stage separated by commas: cuda:0,cuda:1; "
                            "inputs go to the first stage's device, targets to the last's, activations and "
                            "gradients between the stages' devices")),
    Option("diagnose_every", "int", 0, "every K-th micro-batch, measure per stage how far the weights its forward "
           "used were from those live at its backward, against the stale weights' distance "
           "(metrics['prediction_error']); 0: off", "pipeline",
           Flag("int", metavar="K", group="evaluation during training", only="train", in_config=False,
                help="every K-th micro-batch, measure per stage how far the weights its forward used were from "
                "those live at its backward, against the stale weights' distance (the summary's "
                "prediction_error); 0: off")),
    Option("timeout", "float", DEFAULT_TIMEOUT,
           "under torchrun, seconds a stage waits for a peer before the run fails",
           "pipeline", Flag("float", group="distributed runtime", only="distributed", in_config=False)),
    Option("threads", "Optional[int]", 1,
           "under torchrun on the CPU, compute threads per stage process (1, so that N "
           "processes on N cores do not oversubscribe them); None leaves torch's", "pipeline",
           Flag("int", group="distributed runtime", only="distributed", in_config=False,
                help="compute threads per stage process on the CPU (1, so that N processes on N cores do not "
                "oversubscribe them)")),
    Option("data_parallel", "Optional[int]", None,
           "under torchrun, D replicas of the N-stage pipeline (WORLD_SIZE = N x D; "
           "default: inferred from WORLD_SIZE and the stages); each replica reads its own shard of the data "
           "(a DistributedSampler with num_replicas=pipe.data_parallel_size, rank=pipe.data_parallel_rank) "
           "and each stage averages its gradients over its replicas before every update (buckets sent during "
           "the last backward), so weights, optimizer state and predictions stay identical; losses and "
           "metrics are the means over the replicas", "pipeline",
           Flag("int", metavar="D", group="distributed runtime", only="distributed",
                help="D replicas of the N-stage pipeline, N x D processes (under torchrun: inferred from the "
                "world size and --stages); each replica trains on its shard of every mini-batch (--batch-size "
                "is the whole mini-batch's) and each stage averages its gradients over its replicas before "
                "every update, so weights, optimizer state and predictions stay identical; losses and metrics "
                "are the means over the replicas")),
    Option("shard_replicas", "bool", False, "under torchrun with D >= 2 replicas, shard each stage over its replicas "
           "with torch's FSDP2 (fully_shard on a 2-D DeviceMesh 'pp' x 'dp') instead of replicating it: "
           "parameters, gradients, optimizer state and every weight version the method keeps are held 1/D "
           "per process, each pass gathering the version it needs (torch >= 2.6)", "pipeline",
           Flag("switch", group="distributed runtime", only="distributed",
                help="with D >= 2 replicas (--data-parallel D; under your own torchrun: the world size over "
                "the stages), shard each stage over its replicas with torch's FSDP2 instead "
                "of replicating it: parameters, gradients, optimizer state and every weight version the method "
                "keeps are held 1/D per process, each pass gathering the version it needs (torch >= 2.6)")),
    Option("tensor_parallel", "int", 1, "under torchrun, T processes per stage: each stage's layers split with "
           "torch's tensor parallelism (torch.distributed.tensor.parallel styles on a DeviceMesh 'pp' x 'dp' x "
           "'tp', WORLD_SIZE = N x D x T) by tensor_plan, each process holding about 1/T of the planned "
           "layers' weights, gradients, optimizer state and every weight version the method keeps; what "
           "crosses a cut goes from tensor rank t of stage k to tensor rank t of stage k + 1; with "
           "shard_replicas, each split stage is then sharded over its replicas. Seed every process alike (as "
           "replicas): the T ranks of a stage hold its unsplit weights and draw its dropout each", "pipeline",
           Flag("int", metavar="T", group="distributed runtime", only="distributed",
                help="T processes per stage (N x D x T processes in all): each stage's layers split with torch's "
                "tensor parallelism by the model's own plan (--task image --model mlp|vgg|vgg-bn, --task lm "
                "--model gpt...; a transformers model's base_model_tp_plan), each process holding about 1/T of the "
                "planned layers' weights and optimizer state")),
    Option("tensor_plan", "Optional[dict]", None, "with tensor_parallel > 1, how each layer is split: module-name "
           "patterns of the whole model ('model.layers.*.mlp.up_proj', * matches any part) to torch's styles "
           "(ColwiseParallel(), RowwiseParallel(), ...) or transformers' names ('colwise', 'rowwise', "
           "'colwise_gather_output', ...); only nn.Linear and nn.Embedding layers; default: the model's own "
           "(a transformers model's config.base_model_tp_plan and its head's _tp_plan)", "pipeline",
           api_only="a dict; the command line uses the model's own plan"),
    Option("world", "Any", None, "where the stages run: default one pipeline rank per process under torchrun, else every "
           "stage in this process; LocalWorld() keeps every stage here even inside a torchrun job", "pipeline",
           api_only="an object"),
    # -- the method's own options -----------------------------------------------------------
    Option("steps", "str", "exact", "the prediction's step count s: exact (the updates before this mini-batch's "
           "backward, min(t, N-1-k)), paper (N-1-k), or code (N-k, as the authors' code)", "method",
           Flag(group="method"), choices=("exact", "paper", "code")),
    Option("backward", "str", "latest", "the weights of the backward pass: latest (the paper) or predicted (the "
           "forward's, stashed)", "method", Flag(group="method"),
           choices=("latest", "predicted")),
    Option("sgd_momentum", "str", "paper", "with SGD momentum, Delta = m (paper) or mu*m + (1-dampening)*g (the "
           "authors' code)", "method", Flag(group="method"), choices=("paper", "code")),
    Option("vertical_sync", "bool", False, "every stage uses stage 0's weight version", "method",
           Flag("switch", group="method"), choices=(False, True)),
    Option("lr_correction", "str", "none", "delay (PipeMare): stage k with delay tau = N-1-k applies "
           "lr(t) / tau ** (1 - min(t/T, 1)); the prediction uses the corrected lr; no weight copy", "method",
           Flag(group=CORRECTIONS), choices=("none", "delay")),
    Option("lr_correction_steps", "Optional[int]", None,
           "T, the updates over which the delay correction anneals to the "
           "scheduled lr", "method",
           Flag("int", metavar="T", group=CORRECTIONS, note="default: 30% of the run's updates")),
    Option("horizon", "str", "constant", "scheduled: the prediction spans the scheduler's lrs of the next s updates, "
           "not s * lr(t) (equal under a constant lr); no weight copy", "method", Flag(group=CORRECTIONS),
           choices=("constant", "scheduled")),
    Option("delta", "str", "optimizer", "ema: Delta is the moving average of the updates applied, per unit lr (sees "
           "weight decay, clipping, schedules; any optimizer); one more weight copy per stage", "method",
           Flag(group=CORRECTIONS), choices=("optimizer", "ema")),
    Option("ema_decay", "Optional[float]", None, "the decay of delta=ema (default 0.9)", "method",
           Flag("float", metavar="G", group=CORRECTIONS, help="the decay of --delta ema (default 0.9)")),
    Option("prediction_warmup", "int", 0, "the prediction's step count ramps as s * min(1, t/T) over the first T "
           "updates", "method", Flag("int", metavar="T", group=CORRECTIONS)),
    Option("error_feedback", "bool", False, "the methods with a one-update delay (2BW's schedule): each update's "
           "error against the one before, u_t - u_(t-1) (u = the step the optimizer applied), is added to the "
           "weights with it, for any optimizer; one weight-sized buffer and a scratch copy per stage",
           "method", Flag("switch", group=CORRECTIONS), choices=(False, True)),
    Option("predict_feedback", "bool", False, "pipeoptim-2bw with error_feedback: the prediction extrapolates the "
           "update the weights will receive, the optimizer's step and the feedback's term, W - (s+1)*lr*Delta + "
           "u_(t-1) (each of the s updates corrected, each step lr*Delta; it differs from the plain prediction "
           "only as lr*Delta differs from the step just applied, u_(t-1): a schedule's lr change, decoupled "
           "decay); off by default: the study's error-feedback rows ran without it, and it has not shown at "
           "equal time that it helps", "method",
           Flag("switch", group=CORRECTIONS, help="with --error-feedback (pipeoptim-2bw): the prediction "
                "extrapolates the update the weights will receive, the optimizer's step and the feedback's "
                "term; off by default: it has not shown at equal time that it helps"), choices=(False, True)),
    Option("sync_warmup", "int", 0, "the run's first K mini-batches run 1F1B with a flush (no staleness), then the "
           "method's asynchronous schedule", "method", Flag("int", metavar="K", group=CORRECTIONS)),
    # -- fit ----------------------------------------------------------------------------------
    Option("epochs", "int", 1, "passes over the loader (iterated once per epoch; len() is used when it exists)",
           "fit", Flag("int", group="task and data", default=NOT_GIVEN,
                       help="passes over the training data (default: the task's recipe)")),
    Option("eval_loader", "Optional[Iterable[Any]]", None,
           "after each epoch (and every eval_every), evaluate() on this loader with "
           "metric; the value is the epoch's metric", "fit", api_only="an iterable; the command line "
           "evaluates the task's test (or --holdout validation) split"),
    Option("metric", "Optional[Callable[..., Any]]", None,
           "metric(output, target): a mini-batch's value (a mean over it) for eval_loader; "
           "default: the loss", "fit", api_only="a function; the task's"),
    Option("evaluate", "Optional[Callable[..., Any]]", None,
           "evaluate(model) -> float after each epoch instead of eval_loader: a function "
           "written for a model on one device (under torchrun the model gathered on each replica's first "
           "stage)", "fit", api_only="a function; the task's"),
    Option("eval_every", "Optional[int]", None,
           "also drain and evaluate every K mini-batches of an epoch, for curves of the "
           "metric against updates and time (metrics['evaluations']: epoch, batch, updates, metric, "
           "seconds); synchronous methods train the same whatever K, asynchronous ones restart their "
           "warm-up after each drain, so their results depend on K; not with continuous", "fit",
           Flag("int", metavar="K", group="evaluation during training",
                help="also drain and evaluate every K mini-batches of an epoch, for curves of the metric against "
                "updates and time (the run folder's evaluations); synchronous methods train the same whatever K, "
                "asynchronous ones restart their warm-up after each drain, so their results depend on K; not "
                "with --continuous")),
    Option("eval_in_bubbles", "bool", False,
           "run each eval_every evaluation of eval_loader in the idle time (bubbles) "
           "of the next mini-batch instead of after the drain: each stage's eval-mode forward of every "
           "evaluation mini-batch is placed by list scheduling before that stage's next update, on the weights "
           "the drained evaluation would use, so the metric is the same to the bit "
           "(docs/architecture.md, \"Evaluation in the bubbles\"); what the bubbles cannot hold runs just before "
           "the update; synchronous methods with one stage per rank (gpipe, 1f1b-flush, zb-h1, sequential), in "
           "one process or under torchrun with one replica; the epoch-end evaluations, and one where a "
           "checkpoint is written, stay drained",
           "fit", Flag("switch", group="evaluation during training",
                       help="run each --eval-every evaluation in the idle time (bubbles) of the next mini-batch "
                       "instead of after the drain, on the weights the drained evaluation would use, so the "
                       "metric is the same to the bit; what the bubbles cannot hold runs just before the "
                       "update; synchronous methods with one stage per rank (gpipe, 1f1b-flush, zb-h1, "
                       "sequential), one replica; the epoch-end evaluations, and one where a checkpoint is "
                       "written, stay drained")),
    Option("on_batch", "Optional[Callable[..., Any]]", None,
           "on_batch(index, loss) as each mini-batch's loss completes", "fit",
           api_only="a function"),
    Option("on_epoch", "Optional[Callable[..., Any]]", None,
           "on_epoch(epoch, entry) after each epoch", "fit", api_only="a function"),
    Option("on_eval", "Optional[Callable[..., Any]]", None,
           "on_eval(entry) after each evaluation", "fit", api_only="a function"),
    Option("log_dir", "Optional[Union[str, os.PathLike]]", None,
           "write TensorBoard event files there (torch's SummaryWriter; the tensorboard package), from rank 0: "
           "against the update number and the wall time, each mini-batch's loss with its update's lr (per "
           "stage where the stages' differ), each evaluation, each epoch's loss, samples/s and prediction "
           "diagnostic (diagnose_every), and at the end the run's samples/s and each stage's memory: the "
           "numbers the callbacks receive (pipeoptim.run_log names the tags)", "fit",
           Flag("str", name="--tensorboard", metavar="DIR", group="output", only="train", config="tensorboard",
                help="write TensorBoard event files into DIR (needs the tensorboard package): against the "
                "update number and the wall time, each mini-batch's loss with its update's lr, each evaluation, "
                "each epoch's loss, samples/s and prediction diagnostic (--diagnose-every), and at the end the "
                "run's samples/s and each stage's memory (the losses, evaluations and epochs as the run folder's "
                "metrics.jsonl holds them); watch with `tensorboard --logdir DIR`")),
    Option("wandb", "Optional[str]", None,
           "log the same scalars as log_dir to a Weights & Biases run of this project (wandb.init(project=...); "
           "the wandb package), from rank 0; wandb reads WANDB_MODE itself (offline: kept on disk for "
           "`wandb sync`)", "fit",
           Flag("str", metavar="PROJECT", group="output", only="train",
                help="log the scalars --tensorboard writes to a Weights & Biases run of PROJECT (needs the wandb "
                "package); WANDB_MODE=offline keeps it on disk for `wandb sync`")),
    Option("checkpoint_dir", "Optional[Union[str, os.PathLike]]", None,
           "drain and write a checkpoint there (torch's distributed checkpoint, keyed by "
           "the model's parameter names; it loads into any layout of the same model) every checkpoint_every "
           "mini-batches and at each epoch's end", "fit",
           api_only="the command line checkpoints into its run folder (--out)"),
    Option("async_checkpoint", "bool", False,
           "write each checkpoint in the background (torch's dcp.async_save): training "
           "goes on once the state is copied in memory, and the checkpoint becomes the latest when its files "
           "are complete (at the next checkpoint, or at the end of fit; a run that dies first resumes from "
           "the one before)", "fit",
           Flag("switch", group="output", only="train",
                help="write each checkpoint in the background (torch's dcp.async_save): training goes on once "
                "the state is copied in memory, and the checkpoint becomes the latest when its files are "
                "complete (at the next checkpoint, or at the end of the run; a run that dies first resumes "
                "from the one before)")),
    Option("checkpoint_every", "Optional[int]", None,
           "drain and checkpoint every K mini-batches of an epoch (and always at "
           "each epoch's end)", "fit",
           Flag("int", metavar="K", group="output", only="train")),
    Option("resume", "bool", False, "continue from the newest whole checkpoint in checkpoint_dir (one torn or "
           "damaged is passed over for the one before), or train from the beginning where there is none yet, "
           "so that one call serves the first start and every restart (torchrun --max-restarts; a job "
           "re-formed on fewer processes continues with fewer replicas); rank 0 says which on stderr. "
           "Resumed, it reaches the losses of an uninterrupted run (the same checkpoint_every and eval_every; "
           "the loader gives the same mini-batches: a list, or a DataLoader that shuffles with torch's "
           "global generator)", "fit",
           Flag("path", name="--resume", metavar="RUN_DIR", group="output", only="train", default=NOT_GIVEN,
                in_config=False, const=True,
                help="continue the run in RUN_DIR, with its settings, from its newest whole checkpoint, to the "
                "losses of an uninterrupted run; without RUN_DIR, continue the run in --out if it has a "
                "checkpoint, else start it there (one command line for the first start and every restart, "
                "e.g. under torchrun --max-restarts; a job re-formed on fewer processes keeps the stages and "
                "continues with fewer replicas, unless the run was given --data-parallel)")),
    Option("continuous", "bool", False, "every epoch in one schedule, no drain between epochs (asynchronous "
           "methods; evaluation only at the end)", "fit", Flag("switch")),
)

#: every option by name
BY_NAME: Dict[str, Option] = {o.name: o for o in OPTIONS}


def of_scope(*scopes: str) -> List[Option]:
    """The options of these scopes, in the table's order."""
    return [o for o in OPTIONS if o.scope in scopes]


def takers(name: str, methods: Dict[str, Any]) -> List[str]:
    """The methods (of the registry ``methods``: name -> Method) that take the method option ``name``."""
    return [m for m, method in methods.items() if name in method.options]


def describe(options: Sequence[Option], indent: int = 8, width: int = 96) -> str:
    """The options as a docstring's ``Args`` entries: ``name: meaning (default ...)``."""
    lines = []
    for o in options:
        default = " Required." if o.default is REQUIRED else \
            "" if o.default is None or o.default is False else f" Default: {o.default!r}."
        text = f"{o.name}: {o.help}.{default}"
        lines += textwrap.wrap(text, width, initial_indent=" " * indent, subsequent_indent=" " * (indent + 4))
    return "\n".join(lines)
