"""`python -m loadtest ...` is `sluice bench ...`."""

from loadtest.cli import main

raise SystemExit(main())
