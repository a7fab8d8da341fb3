# The compiled module's interface (ckptstore/store/_gather.c); used through
# ckptstore.store.checksum.gather_crc32c and first_mismatch.
from collections.abc import Sequence
from typing import Any

hardware_crc32c: int

def gather(
    out: Any,
    arrays: Sequence[Any],
    leaves: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
    /,
) -> tuple[list[int | None], list[int]]: ...
def first_mismatch(
    buf: Any,
    leaves: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
    recorded: Sequence[int],
    /,
) -> tuple[int, int] | None: ...
