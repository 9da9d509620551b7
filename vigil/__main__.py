"""`python -m vigil` runs the CLI, like the `vigil` console script."""

from vigil import cli

raise SystemExit(cli.main())
