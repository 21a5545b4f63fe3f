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

.PHONY: setup models milestone test test-quick browser lab workbook check status reset

setup: $(STAMP)

$(STAMP): pyproject.toml tools/bootstrap.sh
	@PYTHON=$(PYTHON) bash tools/bootstrap.sh
	@touch $@

models: setup
	@$(VPY) tools/prepare_models.py

milestone: models
	@$(VPY) examples/stage1_milestone.py

test:
	@$(PYTHON) tools/workbook.py status   # stop before touching anything if you have local work
	@$(MAKE) --no-print-directory models browser
	@$(VPY) tools/test_all.py $(if $(CH),--chapter $(CH))

test-quick:
	@$(PYTHON) tools/workbook.py status
	@$(MAKE) --no-print-directory models
	@$(VPY) tools/test_all.py --quick

browser:
	@bash tools/install_browser.sh

lab: models
	$(VENV)/bin/jupyter lab --notebook-dir=.

workbook: setup
	$(VPY) tools/workbook.py build

check: setup
	$(VPY) tools/workbook.py check

status:
	@$(PYTHON) tools/workbook.py status

reset: setup
	@test -n "$(CH)" || (echo "usage: make reset CH=04 [NB=1]   (backs up your chapter-04 modules, and with NB=1 its notebook, then restores the reference)"; exit 2)
	$(VPY) tools/workbook.py reset $(CH) $(if $(NB),--notebook)
