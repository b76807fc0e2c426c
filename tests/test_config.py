"""One configuration from every entry point (issue 50 item 2): an option given to the Pipeline,
to train, to fit or on the command line arrives unchanged where the run reads it (the
Pipeline's PipelineConfig, the one every stage holds, fit's FitConfig), and each option has one
default at every entry point. A copy that drops an option, or a second default, fails here.

The values tried are made from each option's type in the table (pipeoptim.options), so that an
option added there is tried with no edit here."""
from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import inspect
import types
import typing
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

import pipeoptim
import pipeoptim.pipeline as pipeline_module
from pipeoptim.checks import check_method_options
from pipeoptim.cli import build_parser
from pipeoptim.cli.common import run_config
from pipeoptim.cli.flags import cli_default
from pipeoptim.config import FitConfig, PipelineConfig
from pipeoptim.lab import experiment
from pipeoptim.lab.config import RECORDED, RunConfig, record_name
from pipeoptim.options import REQUIRED, Option, of_scope

LOSS = nn.functional.cross_entropy


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def data(n: int = 4) -> List[Any]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


class Arrived(Exception):
    """Raised where a configuration arrives: the test has what it came for."""

    def __init__(self, config: Any) -> None:
        super().__init__("arrived")
        self.config = config


def another(option: Option) -> Any:
    """A value of the option's type other than its default (no check reads it here)."""
    hint = typing.get_type_hints(PipelineConfig if option.scope == "pipeline" else FitConfig)[option.name]
    kinds = set(typing.get_args(hint)) | {hint}
    default = option.default
    if bool in kinds and isinstance(default, bool):
        return not default
    if int in kinds:
        return (default or 0) + 3
    if float in kinds:
        return (default or 0.0) + 1.5
    if str in kinds:
        return f"not-{default}"
    if typing.get_origin(hint) is typing.Union and any(typing.get_origin(k) is not None for k in kinds) \
            and not any(typing.get_origin(k) is collections.abc.Callable for k in kinds):
        return [1, 2]  # a sequence, or an iterable
    return types.SimpleNamespace(option=option.name)  # a function, an object: anything that is not the default


def given(scope: str) -> Dict[str, Any]:
    return {o.name: another(o) for o in of_scope(scope)}


@pytest.fixture
def stop_at_build(monkeypatch):
    """The Pipeline stops where it receives its configuration."""
    def build(self, model, config):
        raise Arrived(config)
    monkeypatch.setattr(pipeline_module.Pipeline, "_build", build)


@pytest.fixture
def stop_at_fit_run(monkeypatch):
    """fit stops where its loop receives its configuration."""
    def fit_run(pipe, loader, config):
        raise Arrived(config)
    monkeypatch.setattr(pipeline_module, "FitRun", fit_run)


def test_every_pipeline_option_reaches_the_pipeline_from_the_pipeline_and_from_train(stop_at_build):
    options = given("pipeline")
    for name, value in options.items():
        for entry in (lambda **kw: pipeoptim.Pipeline(mlp(), **kw), lambda **kw: pipeoptim.train(mlp(), data(), **kw)):
            with pytest.raises(Arrived) as arrived:
                entry(**{"optimizer": sgd, name: value, "steps": "paper"})
            assert getattr(arrived.value.config, name) is value, name
            assert arrived.value.config.method_options == {"steps": "paper"}  # a method's option, apart


def test_every_fit_option_reaches_fits_loop_from_fit_and_from_train(stop_at_fit_run, tmp_path):
    """Each alone, or with what it needs beside it (fit refuses it alone)."""
    needs = {"eval_every": {"evaluate": len}, "eval_in_bubbles": {"eval_every": 2, "eval_loader": data(1)},
             "resume": {"checkpoint_dir": tmp_path}}
    pipe = pipeoptim.Pipeline(mlp(), method="gpipe", stages=2, loss_fn=LOSS, optimizer=sgd)
    for name, value in given("fit").items():
        if name == "epochs":
            value = 3
        keywords = {name: value, **needs.get(name, {})}
        for entry in (lambda **kw: pipe.fit(data(), **kw),
                      lambda **kw: pipeoptim.train(mlp(), data(), method="gpipe", stages=2, loss_fn=LOSS,
                                                   optimizer=sgd, **kw)):
            with pytest.raises(Arrived) as arrived:
                entry(**keywords)
            for key, expected in keywords.items():
                assert getattr(arrived.value.config, key) is expected, (name, key)


def test_every_stage_is_built_from_the_run_the_checks_resolved():
    pipe = pipeoptim.Pipeline(mlp(), method="pipeoptim", stages=2, loss_fn=LOSS, optimizer=sgd, steps="paper",
                              diagnose_every=3)
    assert isinstance(pipe.config, PipelineConfig) and pipe.config.method_options == {"steps": "paper"}
    assert pipe.spec.options == check_method_options(pipe.method, {"steps": "paper"})  # the defaults filled once
    assert (pipe.spec.options["steps"], pipe.spec.diagnose_every) == ("paper", 3)
    assert [(stage.policy.steps_policy, stage.probes.every) for stage in pipe.stages] == [("paper", 3)] * 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        pipe.spec.microbatches = 2


# -- the command line ---------------------------------------------------------------------------

#: the command line's value for an option, where the one its flag's type gives does not fit it
FLAG_VALUES = {"devices": "cpu,cpu", "compile": "eager", "partition": "2,2", "ema_decay": "0.5"}
#: what a flag needs beside it for the command line to keep it (its own rules)
FLAG_NEEDS = {"clip_scope": ["--clip-grad", "1.5"], "continuous": ["--method", "pipeoptim"]}


def flag_arguments(option: Option) -> List[str]:
    flag = option.flag
    name = flag.flag_name(option.name)
    if flag.type == "switch":
        return [name]
    if option.name in FLAG_VALUES:
        value = FLAG_VALUES[option.name]
    elif flag.choices or option.choices:
        choices = flag.choices or option.choices
        value = str(next(c for c in choices if c != cli_default(option) and c != option.default))
    else:
        value = {"int": "3", "float": "1.5", "norm": "1.5", "ints": "2,2", "path": "somewhere", "str": "a-value"}[flag.type]
    return [name, value]


def parsed(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["train", "--task", "image", *argv])


@pytest.mark.parametrize("option", RECORDED, ids=[o.name for o in RECORDED])
def test_every_flag_reaches_the_run_configuration(option):
    args = parsed(*flag_arguments(option), *FLAG_NEEDS.get(option.name, []))
    cfg = run_config(args, args.method)
    expected = getattr(args, record_name(option))
    if option.name == "devices":
        expected = expected.split(",")
    part = cfg.pipeline if option.scope == "pipeline" else cfg.fit
    assert getattr(part, option.name) == expected
    assert expected != option.default  # the flag did set it
    assert RunConfig(**cfg.record()) == cfg  # and the run folder's record keeps it


@pytest.mark.parametrize("option", [o for o in of_scope("method") if o.flag is not None],
                         ids=[o.name for o in of_scope("method") if o.flag is not None])
def test_every_method_flag_reaches_the_method_options(option):
    method = next(m for m, meth in pipeoptim.METHODS.items() if option.name in meth.options)
    needs = {"lr_correction_steps": ["--lr-correction", "delay"], "ema_decay": ["--delta", "ema"],
             "predict_feedback": ["--error-feedback"]}
    args = parsed("--method", method, *flag_arguments(option), *needs.get(option.name, []))
    cfg = run_config(args, method)
    assert cfg.pipeline.method_options[option.name] == getattr(args, option.name) != option.default
    assert cfg.record()["method_options"] == cfg.pipeline.method_options


#: what the command line decides by its own rule (cli.common.run_config says each): the stages
#: (--partition's, else 4), clipping (the recipe's) and the scope that "auto" chose, the epochs
#: (the recipe's)
COMMAND_LINE_RULES = {"stages", "clip_grad_norm", "clip_scope", "epochs"}


def test_each_option_has_one_default_at_every_entry_point():
    """The table's default is the configuration's, the Pipeline's, fit's, train's, the run
    configuration's and the command line's (where no rule of its own decides: the recipe, the
    stages)."""
    train = {n: p.default for n, p in typing.cast(Any, pipeoptim.train).__signature__.parameters.items()}
    pipe = {n: p.default for n, p in pipeoptim.Pipeline.__init__.__signature__.parameters.items()}
    fit = {n: p.default for n, p in pipeoptim.Pipeline.fit.__signature__.parameters.items()}
    cfg = run_config(parsed(), "zb-h1")
    for option in (*of_scope("pipeline"), *of_scope("fit")):
        config = PipelineConfig() if option.scope == "pipeline" else FitConfig()
        signature = pipe if option.scope == "pipeline" else fit
        default = None if option.default is REQUIRED else option.default
        assert getattr(config, option.name) == default, option.name
        assert signature[option.name] == train[option.name], option.name
        assert (signature[option.name] is inspect.Parameter.empty) == (option.default is REQUIRED), option.name
        assert getattr(RunConfig().pipeline if option.scope == "pipeline" else RunConfig().fit, option.name) == default
        if option in RECORDED and option.name not in COMMAND_LINE_RULES:
            assert option.flag.default in (None, option.default), option.name  # no second default
            assert cli_default(option) == option.default, option.name
            assert getattr(cfg.pipeline if option.scope == "pipeline" else cfg.fit, option.name) == option.default
    assert COMMAND_LINE_RULES <= {o.name for o in RECORDED}


# -- the lab: the run configuration to the Pipeline and to fit ----------------------------------

class FakeTask:
    """Enough of a task for the lab's experiment to build and fit a Pipeline."""

    name, metric, higher_is_better, default_model, default_batch_size = "fake", "loss", False, "mlp", 4
    default_lr = {"momentum": 0.1}
    loss = staticmethod(LOSS)

    def model_names(self):
        return ["mlp"]

    def build_model(self, name, data, seed=0):
        return mlp()

    def batch_metric(self):
        return lambda output, target: float(LOSS(output, target))


class FakeData:
    def __init__(self) -> None:
        self.train, self.test = data(4), data(1)

    def split(self, split, what):
        return self.test


def test_the_run_configuration_reaches_the_pipeline_whole(monkeypatch):
    """build_pipeline hands the run's PipelineConfig on as it is, with only what the lab builds
    from its own options (the task's loss, the optimizer and schedule by name) and what the
    stage processes set (devices, timeout, threads, the diagnostic) put in."""
    supplied = {"loss_fn", "optimizer", "lr_scheduler", "devices", "timeout", "threads", "diagnose_every"}
    values = {name: value for name, value in given("pipeline").items() if name not in supplied}
    cfg = RunConfig(model="mlp", batch_size=4, lr=0.1, pipeline=PipelineConfig(**values, method_options={"x": 1}))

    def arrive(model, config):
        raise Arrived(config)
    monkeypatch.setattr(experiment.Pipeline, "from_config", staticmethod(arrive))
    with pytest.raises(Arrived) as arrived:
        experiment.build_pipeline(cfg, FakeTask(), FakeData(), devices="cpu", timeout=7.0, threads=2,
                                  diagnose_every=5)
    config = arrived.value.config
    assert config == cfg.pipeline.replace(**{name: getattr(config, name) for name in supplied})
    assert (config.devices, config.timeout, config.threads, config.diagnose_every) == ("cpu", 7.0, 2, 5)
    assert config.loss_fn is LOSS and callable(config.optimizer)  # (a constant lr: no scheduler)


def test_the_run_configuration_reaches_fit_whole(stop_at_fit_run, monkeypatch):
    """run_experiment hands the run's FitConfig to fit as it is, with only what the lab puts
    in: the evaluation of the task, its callbacks, the run folder's checkpoints, resume. (The
    values need not make a run: the checks of the run's length are left out.)"""
    supplied = {"eval_loader", "metric", "evaluate", "on_batch", "on_epoch", "on_eval", "checkpoint_dir", "resume"}
    fit = FitConfig(**{name: value for name, value in given("fit").items() if name not in supplied})
    monkeypatch.setattr(experiment, "check_spec", lambda *a: None)
    monkeypatch.setattr(pipeline_module, "check_fit", lambda config: None)
    cfg = RunConfig(model="mlp", batch_size=4, lr=0.1, pipeline=PipelineConfig(method="gpipe", stages=2), fit=fit)
    with pytest.raises(Arrived) as arrived:
        experiment.run_experiment(cfg, out_dir=None, show_progress=False, log=lambda *a: None, task=FakeTask(),
                                  data=FakeData())
    config = arrived.value.config
    assert config == fit.replace(**{name: getattr(config, name) for name in supplied})
    assert config.eval_loader is not None and config.on_batch is not None
