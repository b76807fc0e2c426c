"""One definition per option (issue 35 item 2, issue 50 item 2): every option of a run is defined
once, in pipeoptim.options (the engine's) or pipeoptim.lab.config (the lab's); the configuration
objects (pipeoptim.config), the Pipeline's, fit's and train's signatures, the lab's RunConfig and
its record, the command line's flags and its --help are held to those tables: an option in one
of them and not in the others (nor declared API-only or command-line-only) fails here. That each
option given at one entry point arrives where it is read: tests/test_config.py."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import typing

import pytest

import pipeoptim
from pipeoptim.checks import check_method_options
from pipeoptim.cli import build_parser
from pipeoptim.cli.flags import GROUPS, cli_default, flag_help
from pipeoptim.config import FitConfig, PipelineConfig
from pipeoptim.lab.config import DERIVED_FIELDS, LAB_OPTIONS, RECORDED, RunConfig, record_name
from pipeoptim.methods import METHODS
from pipeoptim.options import BY_NAME, NOT_GIVEN, OPTIONS, REQUIRED, of_scope

ALL = (*OPTIONS, *LAB_OPTIONS)


def parameters(function) -> dict:
    """A function's keyword parameters and their defaults (no self, model, loader, **; a required
    one's default as the tables write it, REQUIRED)."""
    return {name: REQUIRED if p.default is p.empty else p.default
            for name, p in inspect.signature(function).parameters.items()
            if name not in ("self", "model", "loader", "batches")
            and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def flags(parser: argparse.ArgumentParser) -> dict:
    """flag -> action, every flag but --help."""
    return {s: a for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def test_the_tables_define_each_option_once_with_its_meaning():
    names = [o.name for o in OPTIONS]
    assert len(names) == len(set(names)) and len({o.name for o in LAB_OPTIONS}) == len(LAB_OPTIONS)
    for option in ALL:
        assert option.help and option.scope in ("pipeline", "fit", "method", "lab", "cli"), option.name
        assert (option.flag is None) == bool(option.api_only), f"{option.name}: a flag, or why it has none"
        assert option.annotation, f"{option.name}: a type"


def test_the_pipeline_takes_exactly_the_pipeline_options_with_their_defaults():
    assert parameters(pipeoptim.Pipeline.__init__) == {o.name: o.default for o in of_scope("pipeline")}


def test_the_configurations_hold_every_option_with_its_type_and_default():
    """PipelineConfig and FitConfig are made from the table: a field per option, of its type,
    with its default (a required option's: None, not given yet), and the method's own options
    apart, as given."""
    for config, scope in ((PipelineConfig, "pipeline"), (FitConfig, "fit")):
        fields = {f.name: f for f in dataclasses.fields(config) if f.name != "method_options"}
        assert list(fields) == [o.name for o in of_scope(scope)]
        hints = typing.get_type_hints(config)
        for option in of_scope(scope):
            assert fields[option.name].default == (None if option.default is REQUIRED else option.default)
            assert hints[option.name] == typing.get_type_hints(_annotated(option.annotation))["x"], option.name
    config = PipelineConfig.of(stages=3, steps="paper")
    assert (config.stages, config.method_options) == (3, {"steps": "paper"})
    assert config.keywords() == {**PipelineConfig(stages=3).keywords(), "steps": "paper"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stages = 4


def _annotated(annotation: str) -> type:
    """A class whose one field has ``annotation``, resolved in pipeoptim.config's names."""
    import pipeoptim.config as module

    return type("Annotated", (), {"__annotations__": {"x": annotation}, "__module__": module.__name__})


def test_fit_takes_exactly_the_fit_options_with_their_defaults():
    assert parameters(pipeoptim.Pipeline.fit) == {o.name: o.default for o in of_scope("fit")}


def test_train_takes_every_pipeline_and_fit_option():
    """train is Pipeline(...).fit(...): its signature is the two tables' (and runtime), the
    method's default included (the Pipeline's: a synchronous pipeline)."""
    expected = {o.name: o.default for o in of_scope("pipeline", "fit")}
    expected["runtime"] = "local"
    got = parameters(pipeoptim.train)
    assert got == expected
    assert got["method"] == parameters(pipeoptim.Pipeline)["method"] == "zb-h1"
    assert pipeoptim.train.__kwdefaults__["method"] == "zb-h1"  # the function's own, not only its signature


def test_every_method_option_is_defined_and_every_defined_one_is_a_methods():
    taken = {key for m in METHODS.values() for key in m.options}
    assert taken == {o.name for o in of_scope("method")}
    resolved = {m: check_method_options(METHODS[m], {}) for m in METHODS}
    for option in of_scope("method"):  # the default the table states is each taker's, one of its choices
        assert {resolved[m][option.name] for m in METHODS if option.name in METHODS[m].options} \
            == {option.default}, option.name
        assert option.choices is None or option.default in option.choices, option.name


def test_the_run_configuration_has_a_field_for_every_option_the_command_line_takes():
    """A field per lab option the record holds, the engine's options embedded whole (with the
    API's defaults: one meaning), and a record that holds every option the command line takes
    under the name its flag parses into."""
    fields = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    lab = {o.name: o for o in LAB_OPTIONS if o.scope == "lab" and o.flag.in_config}
    assert set(fields) - set(DERIVED_FIELDS) == set(lab) | {"pipeline", "fit"}
    for name, option in lab.items():
        assert fields[name] == option.default, name  # the lab's defaults are the table's
    cfg = RunConfig()
    assert (cfg.pipeline, cfg.fit) == (PipelineConfig(), FitConfig())
    wanted = {record_name(o) for o in ALL if o.flag is not None and o.flag.in_config and o.scope not in ("method", "cli")}
    assert set(cfg.record()) - set(DERIVED_FIELDS) - {"method_options"} == wanted
    assert {o.name for o in RECORDED} == {o.name for o in OPTIONS if o.flag is not None and o.flag.in_config} \
        - {o.name for o in of_scope("method")}
    assert RunConfig(**cfg.record()) == cfg  # a record reads back as the configuration it records


def test_the_optimizer_is_a_factory_in_the_engine_and_a_name_in_the_lab():
    """Two meanings, two names: the engine's optimizer (a factory, required by the Pipeline) and
    the lab's optimizer_name, which the flag --optimizer and the record's "optimizer" give."""
    assert BY_NAME["optimizer"].default is REQUIRED and BY_NAME["optimizer"].flag is None
    lab = next(o for o in LAB_OPTIONS if o.name == "optimizer_name")
    assert lab.flag.flag_name(lab.name) == "--optimizer" and record_name(lab) == "optimizer"
    cfg = RunConfig(optimizer="adamw")  # the record's name
    assert cfg.optimizer_name == cfg.optimizer == "adamw" and cfg.pipeline.optimizer is None


@pytest.mark.parametrize("command", ["train", "compare"])
def test_every_flag_of_a_training_command_is_an_option_and_says_what_the_option_means(command):
    parser = subcommand(command)
    by_flag = {o.flag.flag_name(o.name): o for o in ALL if o.flag is not None}
    for flag, action in flags(parser).items():
        assert flag in by_flag, f"{command} {flag} is no option of the tables"
        option = by_flag[flag]
        assert action.help == flag_help(option)
        assert action.default == cli_default(option)
    for flag, option in by_flag.items():
        if option.flag.only in (None, command) or (command == "train" and option.flag.only == "distributed"):
            assert flag in flags(parser), f"{command} lacks {flag}"
        else:
            assert flag not in flags(parser), f"{command} has {flag}, which is {option.flag.only}'s"


def test_train_help_lists_every_training_option_with_its_meaning():
    text = " ".join(subcommand("train").format_help().split())
    for option in ALL:
        if option.flag is not None and option.flag.only in (None, "train", "distributed"):
            assert option.flag.flag_name(option.name) in text
            first = " ".join((option.flag.help or option.help).split()[:6])  # in the command line's words
            assert first in text, option.name


def test_the_docstrings_list_the_options_from_the_tables():
    for option in of_scope("pipeline", "method"):
        assert f"{option.name}: {option.help[:40]}" in " ".join(pipeoptim.Pipeline.__doc__.split())
    for option in of_scope("fit"):
        assert f"{option.name}: {option.help[:40]}" in " ".join(pipeoptim.Pipeline.fit.__doc__.split())
    assert "checkpoint_every:" in pipeoptim.train.__doc__ and "stages:" in pipeoptim.train.__doc__


def test_a_flag_default_never_leaks_a_sentinel():
    for option in ALL:
        if option.flag is not None:
            assert cli_default(option) is not NOT_GIVEN
    assert set(GROUPS) >= {o.flag.group for o in ALL if o.flag is not None}
    assert BY_NAME["stages"].flag.default is NOT_GIVEN  # the recipe's 4, not the API's None


def test_a_flag_with_a_const_takes_its_value_optionally():
    """--compile alone: inductor; --compile BACKEND: that one; not given: no compilation."""
    parser = subcommand("train")
    assert parser.parse_args(["--compile"]).compile == "inductor"
    assert parser.parse_args(["--compile", "aot_eager"]).compile == "aot_eager"
    assert parser.parse_args([]).compile is False
