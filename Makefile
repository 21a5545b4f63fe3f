# The workbook's commands. Run from the repository root.
#   make milestone    set up (virtualenv, packages, models), then run the milestone
#   make test         set up, install Chromium where allowed, then run every test (what CI runs)
#   make test CH=04   the same, for chapter 04 only: its tests, its notebooks, its wrong modules
#   make test-quick   set up, then every test except the slow and the browser ones (a few minutes)
# All are idempotent: a second run skips what is done. Only `make test` installs a browser.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup models milestone test test-quick browser lab workspace adopt workbook check reset

setup: $(STAMP)

$(STAMP): pyproject.toml tools/bootstrap.sh
	@PYTHON=$(PYTHON) bash tools/bootstrap.sh
	@touch $@

models: setup
	@$(VPY) tools/prepare_models.py

milestone: models
	@$(VPY) examples/stage1_milestone.py

test:
	@$(MAKE) --no-print-directory models browser
	@$(VPY) tools/test_all.py $(if $(CH),--chapter $(CH))

test-quick:
	@$(MAKE) --no-print-directory models
	@$(VPY) tools/test_all.py --quick

browser:
	@bash tools/install_browser.sh

# Your notebooks and your package live in workspace/ (git-ignored; created on first use). No
# command writes there except `workspace` (adds what is missing), `adopt` and `reset`, which keep
# every file they replace in workspace/.history/ first.
lab: models workspace
	@echo "Open workspace/notebooks/ (your copies; solutions/ holds the complete chapters)."
	$(VENV)/bin/jupyter lab --notebook-dir=.

workspace: setup
	@$(VPY) tools/workbook.py workspace

adopt: setup
	@test -n "$(REF)" || (echo "usage: make adopt REF='stash@{0}'   (or a branch or commit: copies your minisgl/ and notebooks/ files kept there into workspace/)"; exit 2)
	@$(VPY) tools/workbook.py adopt '$(REF)'

workbook: setup
	$(VPY) tools/workbook.py build

check: setup
	$(VPY) tools/workbook.py check

status:
	@$(PYTHON) tools/workbook.py status

reset: setup
	@test -n "$(CH)" || (echo "usage: make reset CH=04 [NB=1]   (puts chapter 04's reference modules, and with NB=1 its notebook, into workspace/; yours are kept in workspace/.history/)"; exit 2)
	$(VPY) tools/workbook.py reset $(CH) $(if $(NB),--notebook)
