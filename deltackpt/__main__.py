"""``python -m deltackpt``: the same command line as ``deltackpt``."""

from deltackpt.cli import main

raise SystemExit(main())
