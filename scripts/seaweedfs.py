"""Start, stop and inspect a SeaweedFS server for manual runs and benchmarks.

    python scripts/seaweedfs.py start [--dir DIR] [--port P] [--bucket B] [--mount MNT] [--tls]
                                      [--access-key K --secret-key S] [--json]
    python scripts/seaweedfs.py status [--dir DIR]
    python scripts/seaweedfs.py stop [--dir DIR]

The same command as ``python -m ckptstore.testing.local_s3`` (see its docstring): ``start``
runs ``weed mini`` on 127.0.0.1 with its S3 gateway on port 8333 (``--port`` to change it),
creates the bucket, leaves the server running, writes ``DIR/state.json`` and prints the
``s3://`` URL to use and the exact ``stop`` command; ``stop`` unmounts and stops exactly the
PIDs in the state file. Kept for the benchmarks and for readers of older docs.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckptstore.testing.local_s3 import main

if __name__ == "__main__":
    raise SystemExit(main(prog=f"python {sys.argv[0]}"))
