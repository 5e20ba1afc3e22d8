"""``python -m stepwatch`` is the ``stepwatch`` command."""

from .cli import main

raise SystemExit(main())
