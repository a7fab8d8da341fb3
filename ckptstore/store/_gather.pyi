# The compiled module's interface (ckptstore/store/_gather.c); used through
# ckptstore.store.checksum.gather_crc32c and first_mismatch, and
# ckptstore.store.buffers.copy_into.
from collections.abc import Sequence
from typing import Any, Literal, overload

hardware_crc32c: int

@overload
def gather(
    out: Any,
    arrays: Sequence[Any],
    leaves: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
    hashed: Literal[False] = ...,
    /,
) -> tuple[list[int | None], list[int]]: ...
@overload
def gather(
    out: Any,
    arrays: Sequence[Any],
    leaves: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
    hashed: Literal[True],
    /,
) -> tuple[list[int | None], list[int], list[str | None]]: ...
def bind_xxh3(address: int, /) -> None: ...
def copy_from(
    out: Any,
    sources: Sequence[Any],
    offsets: Sequence[int],
    lengths: Sequence[int],
    /,
) -> None: ...
def first_mismatch(
    buf: Any,
    leaves: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
    recorded: Sequence[int],
    /,
) -> tuple[int, int] | None: ...
