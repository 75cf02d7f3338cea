# The two commands of the README's quickstart are `make demo` and `make test`. Each first runs
# scripts/bootstrap.sh for itself (`--plan` shows what it installs): one line per phase on the
# terminal, the whole output in .cache/logs/bootstrap-<target>.log.
.PHONY: demo test unit devcluster lint

PYTEST ?= .venv/bin/pytest

demo:  ## set up PyTorch + Horovod only, then run the main example locally, reduced (ResNet-18 for its ResNet-50, 2 Horovod ranks, synthetic data)
	scripts/bootstrap.sh demo
	.venv/bin/trainop run examples/pytorch-horovod-synthetic.yaml --local

test:  ## set up everything (adds to what demo installed), then run the whole test suite (what CI runs)
	scripts/bootstrap.sh test
	scripts/test_lanes.py $(PYTEST) -ra --durations=20; rc=$$?; \
	  if [ $$rc = 5 ]; then echo "make test: no tests ran; that is a failure" >&2; exit 1; fi; exit $$rc

unit:  ## only the tests that need no cluster, Azurite or training
	$(PYTEST) tests/unit -q

lint:  ## ruff with the rule set in pyproject.toml (tests/unit/test_lint.py runs it in `make test`)
	.venv/bin/ruff check .

devcluster:  ## start the local control plane with simulated AKS GPU pools
	.venv/bin/trainop devcluster up
