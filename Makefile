# pagedserve: `make serve` runs the stack, `make test` lint + the whole suite, `make bench-*` the benchmarks.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-fast lint protos serve bench-blockmgr bench-engine bench-cpu bench-host bench-async clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# No CUDA on this machine: take the CPU torch wheel first, so the project's
	# `torch` requirement is already satisfied and pip pulls no CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	# `dev` brings triton (the kernel tests run it on the CPU, under its interpreter). The
	# filter drops setuptools' "Editable installation" notice (a warning block for any
	# editable install of a flat layout), that message alone: errors still show.
	PYTHONWARNINGS='ignore:Editable installation' $(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

protos: $(STAMP)
	$(PY) -m pagedserve._protogen

# Lint keeps the house: style, the import contract (pyproject's [tool.importlinter]), no file
# over 500 lines in services/ or pagedserve/kernels/, and mypy on services/.
lint: protos
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) -m pagedserve.tools.check_file_sizes
	$(VENV)/bin/mypy

# The whole suite (CI), on TEST_WORKERS pytest-xdist workers (a test module stays on one
# worker, so its module-scoped stacks start once). The 25 slowest tests close the output:
# docs/testing.md has the budgets.
TEST_WORKERS ?= 2
test: protos lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=25

# The inner loop: everything but the tests that start processes (e2e), run Triton kernels
# under the interpreter (interp) or repeat a sweep for another model or configuration
# (matrix), with a quarter of the hypothesis examples. Markers: tests/markers.py.
test-fast: protos
	$(PY) -m pytest -q -n 2 -m "not e2e and not interp and not matrix" --hypothesis-profile=fast

# The whole stack on loopback: blockmgr + executor + gateway (localhost:50051). Without
# MODEL=DIR it serves the tiny default model, written to models/tiny-llama on first use.
serve: protos
	$(VENV)/bin/pagedserve serve $(if $(MODEL),--model $(MODEL),) $(SERVE_ARGS)

bench-blockmgr: protos
	$(PY) -m bench.blockmgr_bench

bench-engine: protos
	$(PY) -m bench.engine_bench --grpc

bench-cpu: protos
	$(PY) -m bench.cpu_bench

bench-host: protos
	$(PY) -m bench.internals.host_bench

bench-async: protos
	$(PY) -m bench.internals.async_bench

clean:
	rm -rf $(VENV) pagedserve/v1/*_pb2*.py pagedserve/v1/*_pb2*.pyi
