# Shortcuts for the two README commands (make is optional: the scripts are the source).
.PHONY: setup demo test
setup:
	bash scripts/setup.sh
demo:
	bash scripts/demo.sh
test:
	bash scripts/test.sh
