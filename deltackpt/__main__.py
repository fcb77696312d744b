"""``python -m deltackpt``: the same command line as ``deltackpt``."""

from deltackpt.cli.main import main

raise SystemExit(main())
