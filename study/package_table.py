"""The study's conclusions as the package ships them: ``src/pipeoptim/lab/tasks/equal_time_study.json``,
the recommendation per finished (task, N) (what ``pipeoptim.lab.tasks.advice.ADVICE`` reads) and
the ratios of updates to the target of those settings (``UPDATES_TO_TARGET`` of
``pipeoptim.lab.tasks.updates_to_target``).

``python -m study.make_results3 --package`` writes the file from the committed rows (the advice:
make_results7.package_advice, the confirmation on fresh seeds; the ratios: make_results3_targets.package_targets);
study/tests/test_make_results3.py holds the file to what those rows give, byte for byte. The
entries are the dataclasses' fields in their order, a pair of (option, value) as a 2-item list."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from study.common import ROOT

#: the file the package reads (pyproject's package-data ships it)
PACKAGE_TABLE = ROOT / "src" / "pipeoptim" / "lab" / "tasks" / "equal_time_study.json"
FORMAT = "pipeoptim-equal-time-study"
COMMAND = "python -m study.make_results3 --package"


def _listed(options: Tuple[Tuple[str, str], ...]) -> list:
    return [list(pair) for pair in options]


def table(advice: Dict[Tuple[str, int], Dict[str, Any]],
          targets: Dict[Tuple[str, str, int], Dict[str, Any]]) -> Dict[str, Any]:
    """The file's contents: ``advice`` (make_results3_advice.advice_entries's) and ``targets``
    (make_results3_targets.target_entries's) in their order."""
    return {
        "format": FORMAT, "version": 2,
        "written_by": f"{COMMAND} (from the committed rows in study/results/; do not edit by hand)",
        "advice": [{**entry, "options": _listed(entry["options"])} for entry in advice.values()],
        "updates_to_target": [{**entry, "variants": [{**v, "options": _listed(v["options"])} for v in entry["variants"]]}
                              for entry in targets.values()]}


def text(contents: Dict[str, Any]) -> str:
    """The file's text: one field a line (the file stays readable and diffable)."""
    return json.dumps(contents, indent=1) + "\n"


def package_text(study: Path, arm: Optional[Path], translation: Optional[Path] = None,
                 feedback: Optional[Path] = None) -> str:
    """The file's text from the study's folders (issue 23's rows, issue 38's arm's, issue 41's
    translation cell's, issue 51's arms')."""
    from study.make_results3_targets import package_targets
    from study.make_results7 import package_advice

    return text(table(package_advice(),
                      package_targets(study, arm, translation, feedback)))


def write(study: Path, arm: Optional[Path], translation: Optional[Path] = None, feedback: Optional[Path] = None,
          out: Path = PACKAGE_TABLE) -> Path:
    out.write_text(package_text(study, arm, translation, feedback))
    return out
