"""``python -m ckptstore``: the same command as the ``ckptstore`` entry point."""

from __future__ import annotations

from ckptstore.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
