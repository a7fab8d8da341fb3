"""What ckptstore says on its loggers (issue 30): one INFO record per save, restore, copy and
gc with the step, bytes, objects, seconds, throughput and the root's URL; DEBUG per request
of an object store; nothing printed when the application configures no logging; no
credential in any record."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.cli.main import main
from tests.children import python_path

STATE = {"w": np.arange(1 << 18, dtype=np.float32), "b": np.ones(7), "step": 3}


def records(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name]


def test_one_info_record_per_save_restore_copy_and_gc(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.INFO, logger="ckptstore")
    root, copy = tmp_path / "run", tmp_path / "copy"
    ckptstore.save(root, STATE, step=3)
    ckptstore.load(root, keys=["w"])
    assert main(["cp", str(root), str(copy), "--no-progress"]) == 0
    ckptstore.gc(root, grace=0)

    (saved,) = records(caplog, "ckptstore.save")
    assert saved.startswith(f"saved step 3 to {root.as_uri()}: ")
    assert " 1.0 MiB written (0.0 MiB referenced) in " in saved
    assert saved.endswith(" MiB/s")
    (restored,) = records(caplog, "ckptstore.restore")
    assert restored.startswith(f"restored step 3 from {root.as_uri()}: 1 of 2 leaves, 1.0 MiB")
    (copied,) = records(caplog, "ckptstore.copy")
    assert copied.startswith(f"copied step 3 from {root.as_uri()} to {copy.as_uri()}: ")
    assert "1.0 MiB, verified, in " in copied
    assert copied.endswith("; 0 objects of earlier steps referenced at the destination")
    (collected,) = records(caplog, "ckptstore.gc")
    assert collected.startswith(f"gc of {root.as_uri()} (grace 0 s): removed 0 abandoned")


@pytest.mark.s3
def test_requests_at_debug_and_no_credential_in_any_record(
    caplog: pytest.LogCaptureFixture, moto_s3: Any
) -> None:
    caplog.set_level(logging.DEBUG, logger="ckptstore")
    secret = moto_s3.secret_key
    url = (
        f"s3://{moto_s3.bucket}/logged?endpoint_url={moto_s3.endpoint}&region={moto_s3.region}"
        f"&access_key_id={moto_s3.access_key}&secret_access_key={secret}"
    )
    ckptstore.save(url, STATE, step=1)
    ckptstore.load(url)
    requests = records(caplog, "ckptstore.s3")
    assert any(m.startswith("put ") and " done in " in m for m in requests), requests
    assert any(m.startswith("read ") and " done in " in m for m in requests), requests
    assert len(records(caplog, "ckptstore.save")) == 1
    assert len(records(caplog, "ckptstore.restore")) == 1
    for record in caplog.records:
        assert secret not in record.getMessage(), record.name


def test_nothing_is_printed_without_logging_configured(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        import ckptstore
        root = sys.argv[1]
        ckptstore.save(root, {"w": np.ones(10)}, step=1)
        ckptstore.load(root)
        ckptstore.gc(root, grace=0)
        print("done")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "run")],
        env={**os.environ, "PYTHONPATH": python_path()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "done\n"
    assert done.stderr == ""
