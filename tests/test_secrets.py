"""A marker secret, hunted across every code path that formats a URL or an option set.

Each test gives a fresh marker as a credential (a URL query option such as
``secret_access_key=``, ``token=``, a password in ``endpoint_url``'s userinfo) and then looks
for it everywhere a user could see it: the errors of ``open_store`` for every scheme and their
tracebacks, ``repr``/``str`` of every store and wrapper, log records at DEBUG from every logger,
and the CLI's output and errors, with and without ``--json``, against a store that cannot be
opened, one that cannot be reached and one that works.
"""

from __future__ import annotations

import logging
import socket
import traceback
import uuid
from pathlib import Path

import pytest

from ckptstore import cli, open_store
from ckptstore.store.wrappers import CountingStore, FaultStore, LimitStore
from tests.servers.moto import MotoS3


@pytest.fixture
def marker() -> str:
    """A secret no test has shown the code before (the code remembers secrets it is given)."""
    return f"MARKER{uuid.uuid4().hex}"


def closed_endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def everything_shown(exc: BaseException) -> str:
    """What a user can see of an error: its text, its repr, the whole printed traceback."""
    return "\n".join([str(exc), repr(exc), "".join(traceback.format_exception(exc))])


# URLs that no backend can open, each with the marker where a careless user puts a secret.
BAD_URLS = [
    "s3://user:{m}@bkt/x",
    "s3://bkt/x?secret_access_key={m}&colour=blue",
    "s3://bkt/x?secret_access_key={m}&endpoint_url=notaurl",
    "s3://bkt/x?endpoint_url=http://admin:{m}@127.0.0.1:9",
    "s3://bkt/x?endpoint_url=http://127.0.0.1:9/?token={m}",
    "s3://bkt/x?secret_access_key={m}&access_key_id=AKID&max_attempts=x",
    "s3://bkt/x?broken&secret_access_key={m}",
    "s3:///x?secret_access_key={m}",
    "gs://bkt/x?token=anon&password={m}",
    "gs://bkt/x?token=anon&endpoint_url=http://admin:{m}@127.0.0.1:9",
    "gs:///x?token={m}",
    "file://host/x?token={m}",
    "file:///tmp/x?token={m}",
    "nfs://host/x?token={m}",
    "nosuchscheme://bkt/x?token={m}",
    "fsspec+nosuchprotocol://bkt/x?token={m}",
    "bad scheme://bkt?token={m}",
]
# URLs that open (the query is part of the name there): what shows the store must not show it.
ODD_URLS = ["memory://x?token={m}&y", "fsspec+memory://x?token={m}"]


@pytest.mark.parametrize("template", ODD_URLS)
def test_stores_named_with_a_secret_never_show_it(template: str, marker: str) -> None:
    store = open_store(template.format(m=marker))
    assert marker not in repr(store)
    assert marker not in str(store)


@pytest.mark.parametrize("template", BAD_URLS)
def test_open_store_errors_never_show_the_secret(template: str, marker: str) -> None:
    url = template.format(m=marker)
    with pytest.raises(Exception) as info:  # noqa: PT011  (each URL fails its own way)
        open_store(url)
    assert marker not in everything_shown(info.value)


@pytest.mark.parametrize(
    ("scheme", "options"),
    [
        ("fsspec+s3", {"secret": "{m}", "key": "AKID", "endpoint_url": "http://127.0.0.1:9"}),
        ("fsspec+s3", {"secret": "{m}", "key": "AKID", "endpoint_url": "notaurl"}),
        ("fsspec+s3", {"secret": "{m}", "endpoint_url": "http://u:{m}@127.0.0.1:9"}),
        ("fsspec+memory", {"token": "{m}"}),
        ("fsspec+gs", {"token": "anon", "endpoint_url": "http://127.0.0.1:9", "x_pwd": "{m}"}),
    ],
)
def test_options_given_as_keywords_are_never_shown(
    scheme: str, options: dict[str, str], marker: str
) -> None:
    given = {k: v.format(m=marker) for k, v in options.items()}
    try:
        store = open_store(f"{scheme}://bkt/x", **given)
    except Exception as exc:  # refused, by us or by the driver
        shown = [everything_shown(exc)]
    else:
        shown = [repr(store), str(store), store.url]
    assert all(marker not in text for text in shown)


async def test_reprs_and_errors_of_working_stores_and_wrappers(
    moto_s3: MotoS3, marker: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger: ckptstore's, botocore's, aiohttp's
    url = (
        f"s3://{moto_s3.bucket}/run?endpoint_url={moto_s3.endpoint}&region={moto_s3.region}"
        f"&access_key_id=AKIDVISIBLE&secret_access_key={marker}&session_token=T{marker}"
    )
    s3 = open_store(url)
    local = open_store(str(tmp_path / "local"))
    wrapped = [CountingStore(s3), FaultStore(s3, []), LimitStore(s3, 2), CountingStore(local)]
    async with s3:
        await s3.put("k", b"v")
        assert await s3.get("k") == b"v"
        with pytest.raises(FileNotFoundError) as missing:
            await s3.get("missing")
        await s3.put("m", b"x", mode="create")
        with pytest.raises(FileExistsError) as exists:
            await s3.put("m", b"y", mode="create")
        for store in [s3, *wrapped]:
            for shown in (repr(store), str(store), store.url):
                assert marker not in shown
        for error in (missing.value, exists.value):
            assert marker not in everything_shown(error)
    unreachable = open_store(
        f"s3://bkt/run?endpoint_url={closed_endpoint()}&access_key_id=AKID"
        f"&secret_access_key={marker}"
    )
    async with unreachable:
        with pytest.raises(OSError, match="connection refused") as refused:
            await unreachable.list_keys()
    assert marker not in everything_shown(refused.value)
    assert caplog.records  # the loggers did speak at DEBUG
    assert marker not in caplog.text
    assert all(marker not in str(r.args) for r in caplog.records)


# ---------------------------------------------------------------------- the command line


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out + err


@pytest.mark.parametrize("json", [False, True])
@pytest.mark.parametrize("command", ["ls", "verify", "gc", "show"])
def test_cli_never_shows_the_secret_of_a_store_it_cannot_open_or_reach(
    capsys: pytest.CaptureFixture[str], marker: str, command: str, json: bool
) -> None:
    flags = ["--json"] if json else []
    extra = ["latest"] if command == "show" else []
    cannot_open = [
        f"s3://bkt/run?secret_access_key={marker}&endpoint_url=notaurl",
        f"s3://bkt/run?endpoint_url=http://admin:{marker}@127.0.0.1:9",
        f"s3://user:{marker}@bkt/run",
        f"gs://bkt/run?token=anon&endpoint_url=notaurl&client_secret={marker}",
    ]
    for url in cannot_open:
        status, shown = run(capsys, *flags, command, url, *extra)
        assert status != 0
        assert marker not in shown, shown
    unreachable = (
        f"s3://bkt/run?endpoint_url={closed_endpoint()}&access_key_id=AKID"
        f"&secret_access_key={marker}"
    )
    status, shown = run(capsys, *flags, command, unreachable, *extra)
    assert status != 0
    assert "connection refused" in shown
    assert marker not in shown, shown
    status, shown = run(capsys, *flags, command, "s3://bkt/run", *extra, "-o", f"token={marker}")
    assert status != 0
    assert marker not in shown, shown


@pytest.mark.parametrize("json", [False, True])
def test_cli_never_shows_the_secret_of_a_store_that_works(
    capsys: pytest.CaptureFixture[str], moto_s3: MotoS3, marker: str, json: bool
) -> None:
    flags = ["--json"] if json else []
    url = (
        f"s3://{moto_s3.bucket}/run?endpoint_url={moto_s3.endpoint}&region={moto_s3.region}"
        f"&access_key_id=AKIDVISIBLE&secret_access_key={marker}"
    )
    for argv in (
        ["ls", url],
        ["verify", url],
        ["gc", url],
        ["show", url, "1"],
        ["rm", url, "1"],
        ["tune", url, "--size", "5MiB", "--part-sizes", "5MiB", "--concurrency", "1"],
    ):
        _, shown = run(capsys, *flags, *argv)
        assert marker not in shown, (argv, shown)
    _, shown = run(capsys, *flags, "ls", f"s3://{moto_s3.bucket}/run", "-o", f"token={marker}")
    assert marker not in shown
