# paritykit developer targets. `make demo` and `make test` are the two set-up commands of the README.
PYTHON ?= python3
VENV ?= .venv
# Installed before anything else: an unpinned torch would pull a multi-GB CUDA build.
# Users with their own GPU build override it, e.g. `make install TORCH_SPEC='torch==2.13.0+cu128'`.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# pytest workers for make test: one per core, at most 4 (2 on the CI machines). Whole files go to one worker
# (--dist loadfile): a module's fixtures build its models once, not once per worker that runs one of its tests
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
STAMP := $(VENV)/.paritykit-installed

.PHONY: install test demo lint style bench fuzz claude codex clean-ai

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "[1/4] $(TORCH_SPEC) (about a minute)"
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	@echo "[2/4] paritykit and its dev tools: diffusers, transformers, pytest, ruff, … (about a minute)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@echo "[3/4] reference implementations the tests compare against (installed --no-deps, see below)"
# The test gallery pairs diffusers with the original SD VAE code (taming-transformers-rom1504). That package
# declares torchvision and pytorch-lightning, whose PyPI builds would replace the CPU torch; the one file the
# gallery imports (taming/modules/diffusionmodules/model.py) needs only torch and numpy, hence --no-deps.
	$(BIN)/python -m pip install --quiet --no-deps "taming-transformers-rom1504==0.0.6"
# Sampler parity is tested against k-diffusion, the sampler library behind A1111 and ComfyUI. It declares
# torchvision, clip-anytorch and others that would replace the CPU torch; the two files the tests load
# (k_diffusion/sampling.py, external.py; see tests/kdiffusion.py) need only torch, scipy, torchsde, torchdiffeq
# and tqdm, which the dev extras carry. Hence --no-deps.
	$(BIN)/python -m pip install --quiet --no-deps "k-diffusion==0.1.1.post1"
# Real port pairs take their reference from DiffSynth-Studio's copy of the Wan research models (tests/research.py).
# diffsynth declares torchvision, modelscope and pinned transformers, which would replace the CPU torch; the
# files the tests load need only torch, einops and tqdm. Hence --no-deps.
	$(BIN)/python -m pip install --quiet --no-deps "diffsynth==2.1.12"
	@echo "[4/4] installed into $(VENV)"
	@touch $(STAMP)

# A diffusers source checkout (a work tree, or a git directory) for the tests that run generated diffusers tests
# inside it; empty skips them. The default is where this team's machines keep the fetched repository.
DIFFUSERS_REPO ?= $(firstword $(wildcard /work/.mirror/huggingface+diffusers/repo))

test: install
	PARITYKIT_DIFFUSERS_REPO="$(DIFFUSERS_REPO)" $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

demo: install
	$(BIN)/paritykit demo

lint: install
	$(BIN)/ruff check helpers tests benchmarks
	$(BIN)/ruff format --check helpers tests benchmarks
	$(BIN)/lint-imports

style: install
	$(BIN)/ruff check --fix helpers tests benchmarks
	$(BIN)/ruff format helpers tests benchmarks

bench: install
	$(BIN)/python benchmarks/run_all.py

# The fuzz suite's long profile (`make test` runs the bounded one): statistics per command go to the results file.
fuzz: install
	PARITYKIT_FUZZ=long PARITYKIT_FUZZ_STATS=benchmarks/results/fuzz.txt $(BIN)/python -m pytest -q -p no:warnings tests/fuzz

# Agent skills, through the installer (`paritykit skills install`): one relative link per skill folder, a
# manifest of what was made, never a user's file replaced. It needs only click and the stdlib, so it runs from a
# bare checkout: the venv's python when there is one, else $(PYTHON), with helpers/ on the path.
# `TARGET=/path/to/repo make claude` installs into another checkout (its CLAUDE.md/AGENTS.md stay untouched).
SKILLS_PY := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
SKILLS_CLI = PYTHONPATH="$(CURDIR)/helpers$${PYTHONPATH:+:$$PYTHONPATH}" $(SKILLS_PY) -m paritykit skills
SKILLS_TARGET = --target "$(if $(TARGET),$(TARGET),$(CURDIR))"

claude:
	$(SKILLS_CLI) install --agent claude $(SKILLS_TARGET)

codex:
	$(SKILLS_CLI) install --agent codex $(SKILLS_TARGET)

clean-ai:
	$(SKILLS_CLI) uninstall --agent all $(SKILLS_TARGET)
