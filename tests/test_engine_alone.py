"""The engine stands on its own (issue 35 item 4): ``pip install .`` with no extras, in a clean
virtual environment that holds torch, numpy and tqdm (and what they need) and nothing else,
then ``import pipeoptim`` and a 2-stage ``Pipeline`` on a toy ``nn.Sequential`` trains, its
losses equal to those of this environment's run. The lab's packages (matplotlib, sentencepiece,
sacrebleu) and the test's (transformers, pytest) cannot be imported there.

torch is not installed again (a wheel of hundreds of MB): the clean environment sees this
environment's torch, numpy and tqdm through a folder of links to their distributions alone,
named by a ``.pth`` file, so pip finds them installed and installs nothing but pipeoptim. The
environment is made without pip of its own (installing pip into it costs seconds): this
environment's pip installs into it (``pip --python``, which runs in its interpreter). The run in the
clean environment reads pipeoptim's installed metadata (what ``pip list`` lists); this
environment's run of the same training is in the test's own process."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path
from typing import Set

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINE_DEPENDENCIES = ("torch", "numpy", "tqdm")

#: the training, run in the clean environment and in this process
TRAIN = """
import torch, pipeoptim
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(4)]
pipe = pipeoptim.Pipeline(model, method="pipeoptim", stages=2, loss_fn=nn.functional.cross_entropy,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
result = pipe.fit(batches, epochs=2)
"""
SCRIPT = "import json, sys\nfrom importlib import metadata\n" + TRAIN + """
blocked = {}
for name in ("matplotlib", "sentencepiece", "sacrebleu", "transformers", "pytest"):
    try:
        __import__(name)
        blocked[name] = False
    except ImportError:
        blocked[name] = True
print(json.dumps({"losses": result.losses, "lab_loaded": "pipeoptim.lab" in sys.modules,
                  "blocked": blocked, "file": pipeoptim.__file__,
                  "installed": metadata.distribution("pipeoptim").metadata["Name"]}))
"""


def closure(names) -> Set[str]:
    """The distributions ``names`` need, themselves included (their non-extra requirements)."""
    seen: Set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        dist = metadata.distribution(name)
        key = dist.metadata["Name"].lower()
        if key in seen:
            continue
        seen.add(key)
        for req in dist.requires or []:
            if "extra ==" in req:
                continue
            if ";" in req and not _marker_holds(req.split(";", 1)[1]):
                continue
            todo.append(re.split(r"[\s<>=!~\[;(]", req, maxsplit=1)[0])
    return seen


def _marker_holds(marker: str) -> bool:
    from packaging.markers import Marker  # pip's and setuptools' own; in this environment

    return Marker(marker).evaluate()


def linked_site(folder: Path, names) -> None:
    """A folder of links to the files of the distributions ``names`` need, and only those."""
    folder.mkdir()
    for name in sorted(closure(names)):
        dist = metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            target = Path(dist.locate_file(top))
            if target.exists() and not (folder / top).exists() and top != "__pycache__":
                (folder / top).symlink_to(target)


@pytest.mark.timeout(300)
def test_pip_install_without_extras_trains_a_pipeline_in_a_clean_environment(tmp_path):
    env_dir, site, build_site = tmp_path / "venv", tmp_path / "engine-site", tmp_path / "build-site"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    linked_site(site, ENGINE_DEPENDENCIES)
    own_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    Path(own_site, "engine-deps.pth").write_text(str(site) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", OMP_NUM_THREADS="1")
    # built offline with this environment's setuptools (a build tool, seen by pip's build alone)
    linked_site(build_site, ["setuptools"])
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    install = subprocess.run([*pip, "install", "-q", "--no-build-isolation", str(REPO)],
                             capture_output=True, text=True, env={**env, "PYTHONPATH": str(build_site)},
                             cwd=tmp_path, timeout=240)
    assert install.returncode == 0, install.stderr[-3000:]
    ran = subprocess.run([python, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    out = json.loads(ran.stdout)
    assert out["installed"].lower() == "pipeoptim"  # pip's record of the install, as pip list reads it
    assert out["file"].startswith(own_site)  # the installed copy, not the repository's src/
    assert out["blocked"] == dict.fromkeys(out["blocked"], True) and not out["lab_loaded"]
    import torch

    here: dict = {}
    with torch.random.fork_rng():  # (the training seeds torch's generator; this process's is left as it was)
        exec(TRAIN, here)  # one compute thread here too (tests/conftest.py)
    assert out["losses"] == here["result"].losses
    assert len(out["losses"]) == 8
