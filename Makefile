# The README's two commands: `make run` (the ms-train demo) and `make test` (everything CI
# checks). Both create the virtual environment and install the workspace when needed.
# `make dist` builds every package's wheel and sdist into dist/, for
# `pip install --find-links dist ms-train` in any environment.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PACKAGES := $(sort $(wildcard packages/*))
STAMP := $(VENV)/.ms-installed
# Extra arguments for pytest, e.g. `make test PYTEST_ARGS="-k zero"` (then one pytest runs
# the selection instead of the two lanes).
PYTEST_ARGS ?=
# Where `make dist` puts the wheels and sdists; it empties the folder first.
DIST ?= dist
BUILD_STAMP := $(VENV)/.ms-build-tools

.PHONY: run test test-fast lint typecheck pytest pytest-jobs pytest-rest pytest-alone test-one dist bench-optim bench-kernels bench-kernels-gpu bench-attention-tiles bench-data bench-ckpt bench-ckpt-gpu bench-train bench-kill-soak bench-mesh bench-parallel bench-parallel-memory bench-parallel-tp bench-parallel-tp-memory bench-parallel-gpu-tp bench-health bench-health-overhead bench-health-window bench-health-recovery bench-health-soak bench-health-straggler clean

$(STAMP): requirements/dev.txt tools/ms-testing/pyproject.toml $(addsuffix /pyproject.toml,$(PACKAGES)) \
		$(wildcard packages/*/src/*/_version.py)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c requirements/dev.txt -r requirements/dev.txt
	$(BIN)/python -m pip install --quiet -c requirements/dev.txt --no-build-isolation \
		-e tools/ms-testing $(addprefix -e ,$(PACKAGES))
	@touch $@

# Building needs only the pinned setuptools, not the workspace and its torch.
$(BUILD_STAMP): requirements/dev.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c requirements/dev.txt setuptools
	@touch $@

# One wheel and one sdist per package, built from this tree without build isolation, so
# nothing but PyPI (for setuptools) is reached. setuptools builds in each package's
# build/ folder and would carry a module deleted since the last build into the wheel.
dist: $(BUILD_STAMP)
	rm -rf $(DIST) $(addsuffix /build,$(PACKAGES))
	$(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir $(DIST) $(PACKAGES)
	for p in $(PACKAGES); do \
		(cd $$p && $(abspath $(BIN))/python -c \
			'import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])' \
			$(abspath $(DIST))) >/dev/null || exit 1; \
	done
	@ls -1 $(DIST)

# The demo: the tiny preset on 2 data-parallel CPU ranks (docs in packages/ms-train).
# More options through RUN_ARGS, e.g. make run RUN_ARGS="--set train.steps=1200".
RUN_ARGS ?=
run: $(STAMP)
	$(BIN)/ms-train --preset tiny --nproc 2 $(RUN_ARGS)

# The suite runs in two lanes beside mypy, each on about one core: the whole jobs (the
# slow tests of ms-health and ms-train, and the installed and `make run` demos:
# launchers, torchrun, ranks, faults), whose output streams; and everything else (the
# fast tier, then the other slow tests), whose output is printed whole when it ends.
# conftest.py marks the jobs lane's tests `lane_jobs`. The few tests marked
# `shm_dead_owner` run alone after both (they assert on /dev/shm segments that processes
# in either lane would sweep). Together they run every test once, and all must pass. The
# suite used 17 min of CPU in 21 min of wall time on 2 cores when it ran as one pytest:
# it mostly waits on processes and deadlines. With PYTEST_ARGS (a selection of your
# own), one pytest runs everything selected instead.
ifeq ($(strip $(PYTEST_ARGS)),)
TEST_LANES := pytest-jobs pytest-rest
TEST_AFTER := pytest-alone
else
TEST_LANES := pytest
TEST_AFTER :=
endif
test: lint
	@$(MAKE) --no-print-directory -j3 typecheck $(TEST_LANES)
	@$(if $(TEST_AFTER),$(MAKE) --no-print-directory $(TEST_AFTER))

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# pytest exits 5 when a selection holds no test; that is not a failure here.
pytest: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests were selected"; rc=0; fi; exit $$rc

pytest-jobs: $(STAMP)
	$(BIN)/python -m pytest -m lane_jobs; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests were selected"; rc=0; fi; exit $$rc

pytest-alone: $(STAMP)
	$(BIN)/python -m pytest -m shm_dead_owner -p no:cacheprovider; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests were selected"; rc=0; fi; exit $$rc

# The rest: every test the jobs lane leaves out but the shm_dead_owner ones, its log
# kept in $(REST_LOG) too. Its own cache off: the jobs lane's pytest writes
# .pytest_cache meanwhile.
REST_LOG ?= $(VENV)/pytest-rest.log
pytest-rest: $(STAMP)
	@log=$(REST_LOG); echo "the fast tier and the libraries' slow tests run beside; their output follows when they end (and is in $$log)"; \
	$(BIN)/python -m pytest -m 'not slow and not lane_jobs and not shm_dead_owner' -p no:cacheprovider >$$log 2>&1; a=$$?; \
	$(BIN)/python -m pytest -m 'slow and not lane_jobs and not shm_dead_owner' -p no:cacheprovider >>$$log 2>&1; b=$$?; \
	echo "===== the rest lane: the fast tier, then the other slow tests ====="; \
	cat $$log; rc=0; \
	for c in $$a $$b; do if [ $$c -ne 0 ] && [ $$c -ne 5 ]; then rc=$$c; fi; done; exit $$rc

# The fast tier for the development loop: everything but the tests marked slow
# (multi-process runs, subprocess launches, fresh installs). CI runs them all.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m 'not slow' $(PYTEST_ARGS)

# One package's tests: `make test-one PKG=ms-optim`.
test-one: $(STAMP)
	@test -n "$(PKG)" -a -d "packages/$(PKG)" || { echo "PKG must name a folder in packages/, got '$(PKG)'"; exit 2; }
	$(BIN)/python -m pytest packages/$(PKG) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests were selected"; rc=0; fi; exit $$rc

# Benchmarks (not tests): each prints a table and writes JSON under bench-results/.
bench-optim: $(STAMP)
	$(BIN)/python tools/bench/optim/bench_lamb.py --reps 9
	$(BIN)/python tools/bench/optim/large_batch.py --out bench-results/large_batch --threads 1

bench-kernels: $(STAMP)
	$(BIN)/python tools/bench/kernels/cpu_attention.py --reps 5

bench-data: $(STAMP)
	$(BIN)/python tools/bench/data/format_bench.py --reps 9
	$(BIN)/python tools/bench/data/node_loading.py --reps 3
	$(BIN)/python tools/bench/data/reader_cost.py --reps 5

bench-ckpt: $(STAMP)
	$(BIN)/python tools/bench/ckpt/stall.py --gib 1 --reps 3
	$(BIN)/python tools/bench/ckpt/restore.py --gib 1 --reps 3

bench-train: $(STAMP)
	$(BIN)/python tools/bench/train/throughput.py --reps 12 --diag-reps 4

# Group init of a pp x dp x tp mesh on 8 gloo ranks: build_mesh against one new_group per
# group and init_device_mesh, with torch's per-group init barrier off and on (issue 15).
bench-mesh: $(STAMP)
	$(BIN)/python tools/bench/parallel/mesh_init.py --reps 11

# ms ZeRO-2, DDP and FSDP2 step time under injected latency, over the compute-only step
# and DDP's: the README's runs, every op taking L, then an all-reduce taking 2L (a ring).
bench-parallel: $(STAMP)
	$(BIN)/python tools/bench/parallel/overlap.py --latency block,3block --rounds 5
	$(BIN)/python tools/bench/parallel/overlap.py --latency block,3block --rounds 5 --network ring --out bench-results/parallel_overlap_ring.json

# Memory per rank of a ~100M-parameter model: ms ZeRO-2 against DDP.
bench-parallel-memory: $(STAMP)
	$(BIN)/python tools/bench/parallel/memory.py

# Tensor parallelism under injected latency (L = 0 and one chunk's GEMM): ms fused by
# chunk count and measured, ms unfused, torch DTensor TP, at DP 1 x TP 2 and DP 2 x TP 2.
bench-parallel-tp: $(STAMP)
	$(BIN)/python tools/bench/parallel/tp_overlap.py --rounds 3

# Activation memory per rank between blocks and saved for backward, TP 1, 2 and 4.
bench-parallel-tp-memory: $(STAMP)
	$(BIN)/python tools/bench/parallel/tp_memory.py

# The collective matmuls on 2+ GPUs (NCCL) against torch's SymmetricMemory fused ops.
bench-parallel-gpu-tp: $(STAMP)
	$(BIN)/python tools/bench/parallel/gpu_tp.py

# What the heartbeat sender costs the loop: hb.step() and hb.on_event() per call against
# no-op floors, and the sender thread's CPU per heartbeat (issue 16).
bench-health: $(STAMP)
	$(BIN)/python tools/bench/health/sender_overhead.py --reps 7

# ms-train's tokens/s with --health against --no-health, 2 ranks, paired (issue 16):
# 21 pairs (about 18 min) give the median a 97% interval; with pairs spread +-5% here it
# decides only a cost well away from 1%.
bench-health-overhead: $(STAMP)
	$(BIN)/python tools/bench/health/train_overhead.py --reps 21

# The same cost in one run: ms-health switched on and off in alternating windows of
# 12 steps, blocks of on, off, off, on (about 8 min).
bench-health-window: $(STAMP)
	$(BIN)/python tools/bench/health/window_overhead.py --blocks 60 --window 12

# Each fault class once, ms-health beside plain torchrun --max-restarts (about 10 min).
bench-health-recovery: $(STAMP)
	$(BIN)/python tools/bench/health/recovery.py

# The chaos soak (10 min, a fault about every 2 min, ETTR), then the false-alarm soak
# (10 min, no fault, two CPU hogs beside the job).
bench-health-soak: $(STAMP)
	$(BIN)/python tools/bench/health/soak.py
	$(BIN)/python tools/bench/health/soak.py --no-faults --contention

# Every heartbeat of the soak's job with two CPU hogs beside it, 10 min with no fault and
# 5 min with a rank slowed 1.5x every 40 s, replayed through Straggler's settings.
bench-health-straggler: $(STAMP)
	$(BIN)/python tools/bench/health/straggler_trace.py record \
		--out bench-results/health/straggler_trace_quiet.json
	$(BIN)/python tools/bench/health/straggler_trace.py record --seconds 300 --slow-every 40 \
		--out bench-results/health/straggler_trace_slow.json
	$(BIN)/python tools/bench/health/straggler_trace.py replay \
		bench-results/health/straggler_trace_quiet.json \
		bench-results/health/straggler_trace_slow.json --setting 1.35:3:0.1 \
		--setting 1.35:3:0 --setting 1.25:2:0.1 --setting 1.25:2:0

# Random SIGKILLs of a 2-rank job across saves, reruns, leftovers (issue 14's soak).
bench-kill-soak: $(STAMP)
	$(BIN)/python tools/bench/train/kill_soak.py --trials 12 --kills 2

# Without a CUDA device this prints "no CUDA device" and exits 0, measuring nothing.
bench-kernels-gpu: $(STAMP)
	$(BIN)/python tools/bench/kernels/gpu_kernels.py

# Times the Triton attention kernels' launches (tiles, warps, stages) on this GPU.
bench-attention-tiles: $(STAMP)
	$(BIN)/python tools/bench/kernels/attention_tiles.py

bench-ckpt-gpu: $(STAMP)
	$(BIN)/python tools/bench/ckpt/gpu_stall.py

clean:
	rm -rf $(VENV) $(DIST) .pytest_cache .mypy_cache .ruff_cache .hypothesis
