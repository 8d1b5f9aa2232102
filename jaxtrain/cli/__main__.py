"""`python -m jaxtrain.cli ...` is `jaxtrain ...`."""

from jaxtrain.cli import main

raise SystemExit(main())
