"""``python -m chunkattn_client.cli``: the ``chunkattn`` command."""

from chunkattn_client.cli import main

raise SystemExit(main())
