"""Developer tools beside the product: harnesses that drive the workbench from outside (the
compatibility-matrix runner in tools/matrix/). A tool may import every floor (profilers, engine,
tuning, workbench); nothing of the product imports tools/, only tests/ and the Makefile do. Not
installed with the package: run from the repository root (`python -m tools.matrix ...`)."""
