# The two commands of the README are the contract: `make demo` and `make test`, each from nothing.
PY := .venv/bin/python

.PHONY: setup demo test test-fast bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m pipeoptim compare --task image --methods sequential,gpipe,async-naive,pipedream,pipeoptim \
		--stages 4 --epochs 2 --limit 12000 --out runs/demo --overwrite

test: setup
	$(PY) -m pytest -q tests study/tests

test-fast: setup
	$(PY) -m pytest -q -x tests study/tests -m "not slow"

bench: setup
	$(PY) -m benchmarks.local_overhead

clean:
	rm -rf .venv runs build src/*.egg-info
