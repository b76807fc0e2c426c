"""The options of a run as two frozen objects made from the option table: :class:`PipelineConfig`
(the Pipeline's options and the method's own) and :class:`FitConfig` (fit's).

Each has one field per option of :mod:`pipeoptim.options` in its scope, named, typed and
defaulted as the table says, so that an option added to the table is a field here with nothing
else to edit. A Pipeline hands its PipelineConfig whole to the checks, the preparation and the
stage builders. The signatures of ``Pipeline``, ``fit`` and ``train`` are made here from the
same table (:func:`keyword_parameters`), and the TypeErrors Python would raise for their keywords:
one missing (:func:`missing_required`), one unknown (:func:`check_keywords`, naming the nearest).
Imports no torch.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import os  # noqa: F401  (the annotations name os.PathLike)
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union  # noqa: F401

from .methods import METHODS, Method
from .options import BY_NAME, REQUIRED, Option, of_scope


class _Config:
    """What both configurations do beyond holding their fields."""

    @classmethod
    def of(cls, **keywords: Any) -> Any:
        """The configuration of these keywords. A PipelineConfig takes every other keyword as a
        method's option (when the run is checked, one that is no method's option is refused by
        :func:`check_keywords`, and the method refuses one it does not take); a FitConfig refuses
        it with a TypeError, as Python does a function's unknown keyword."""
        fields = {f.name for f in dataclasses.fields(cls)}
        names = fields - {"method_options"}
        given = {k: v for k, v in keywords.items() if k in names}
        other = {k: v for k, v in keywords.items() if k not in names}
        if "method_options" in fields:
            return cls(**given, method_options=other)
        if other:
            raise TypeError(f"fit() got an unexpected keyword argument {next(iter(other))!r}")
        return cls(**given)

    def keywords(self) -> Dict[str, Any]:
        """The options as the keywords that make them (a method's own options among them)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "method_options"}
        return {**values, **getattr(self, "method_options", {})}

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` (options by name)."""
        return dataclasses.replace(self, **changes)


def _made_from(name: str, options: List[Option], doc: str, extra: Sequence[tuple] = ()) -> type:
    """A frozen dataclass with one field per option (a required option's field defaults to None:
    not given yet; what requires it says so)."""
    fields = [(o.name, o.annotation, dataclasses.field(default=None if o.default is REQUIRED else o.default))
              for o in options]
    cls = dataclasses.make_dataclass(name, [*fields, *extra], bases=(_Config,), frozen=True)
    cls.__module__, cls.__doc__ = __name__, doc
    return cls


PipelineConfig = _made_from(
    "PipelineConfig", of_scope("pipeline"),
    """Every option of a Pipeline, as ``Pipeline(model, **options)`` takes them, and
    ``method_options``: the method's own options given (``steps``, ``lr_correction``, ...; the
    method's defaults fill the rest when the run is checked). Made by ``of(**keywords)``.""",
    [("method_options", "Dict[str, Any]", dataclasses.field(default_factory=dict))])

FitConfig = _made_from("FitConfig", of_scope("fit"),
                       """Every option of :meth:`pipeoptim.Pipeline.fit`, as it takes them.""")


def missing_required(scopes: Sequence[str], given: Iterable[str], what: str) -> None:
    """A TypeError, as Python's for a function's missing keyword, where an option the table
    marks required is not among ``given``."""
    missing = [o.name for o in of_scope(*scopes) if o.default is REQUIRED and o.name not in set(given)]
    if missing:
        raise TypeError(f"{what} missing {len(missing)} required keyword-only argument"
                        f"{'s' if len(missing) > 1 else ''}: {', '.join(map(repr, missing))}")


def check_keywords(method: Method, given: Sequence[str]) -> None:
    """The keywords a Pipeline took beside its own (``given``): each must be some method's option.
    Another is refused as Python refuses a function's unknown keyword (a TypeError): one of fit's
    sent to fit, a misspelling with the nearest keywords of the Pipeline, the methods and fit."""
    for key in given:
        known = BY_NAME.get(key)
        if known is not None and known.scope == "method":
            continue
        if known is not None and known.scope == "fit":
            raise TypeError(f"Pipeline() got fit()'s keyword argument {key!r}: give it to pipe.fit(loader, "
                            f"{key}=...), or to pipeoptim.train")
        score = {name: difflib.SequenceMatcher(None, key, name).ratio() for name in BY_NAME}
        near = [n for n in difflib.get_close_matches(key, list(BY_NAME), n=3, cutoff=0.6)
                if score[n] >= max(score.values()) - 0.15]  # the nearest, and any as near
        raise TypeError(f"Pipeline() got an unexpected keyword argument {key!r}; "
                        + (f"did you mean {' or '.join(_keyword(name, method) for name in near)}?" if near else
                           "its keywords, and each method's: help(pipeoptim.Pipeline)"))


def _keyword(name: str, method: Method) -> str:
    """Keyword ``name`` as a suggestion says it: whose it is, where not the Pipeline's or ``method``'s."""
    scope = BY_NAME[name].scope
    if scope == "fit":
        return f"{name}= (fit()'s)"
    if scope == "method" and name not in method.options:
        owners = [m.name for m in METHODS.values() if name in m.options]
        return f"{name}= (an option of {', '.join(owners)}, not of {method.name})"
    return f"{name}="


def keyword_parameters(*scopes: str, skip: Sequence[str] = ()) -> List[inspect.Parameter]:
    """The options of ``scopes`` as keyword-only parameters, with their types and defaults (a
    required one has none), in the table's order: the signatures ``help()`` and IDEs show for
    ``Pipeline``, ``fit`` and ``train``."""
    hints = {o.name: o.annotation for o in of_scope(*scopes)}
    return [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY,
                              default=inspect.Parameter.empty if o.default is REQUIRED else o.default,
                              annotation=hints[o.name])
            for o in of_scope(*scopes) if o.name not in skip]
