"""Staging torch tensors to host buffers, and rebuilding them on restore.

Tensors are detached and copied byte for byte: the host copy is a numpy view with the matching
numpy dtype (``ml_dtypes`` supplies bfloat16, float8 and complex32, which numpy lacks), so
bfloat16, float8, bool and complex values round-trip bit-exact. Non-contiguous and strided
tensors are made contiguous by the copy itself, never by an extra temporary.

CPU tensors are copied in chunks by the stager's threads (``Tensor.copy_`` releases the GIL).
CUDA tensors are copied into pinned memory with ``non_blocking=True`` on the current stream, and
one event per device is recorded after the last copy; the writer waits on the events before it
reads the bytes, and training kernels queued later on the same stream run after the copies, so
they cannot change what is written.

A lazy snapshot (:mod:`ckptstore.stage.lazy`) checks each tensor's ``_version`` after its
copy (every in-place op bumps it; a ``detach()``-ed view, as ``state_dict()`` returns, shares
its base's counter). Its CUDA tensors are copied by :class:`_CudaCopies`: on a side stream per
device that first waits for an event recorded on the caller's stream at ``save()``, issued by
the background thread into pinned memory with ``non_blocking=True``, each source marked as
used by the side stream (``record_stream``) so the caching allocator does not hand its memory
out while the copy reads it; an event recorded on the side stream after the last copy is what
the fence makes the caller's stream wait for, and what the writer synchronizes on.

Each leaf records its torch dtype, device and ``requires_grad`` (and whether it was an
``nn.Parameter``) so a restore without a target puts it back as it was; a device this machine
does not have (a CUDA checkpoint restored on a CPU host) falls back to the CPU. Those
attributes are read from the manifest and checked before torch sees them: a device string
torch cannot parse, a flag that is not a boolean, or ``requires_grad`` on an integer tensor is
a :class:`~ckptstore.errors.CorruptCheckpointError`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import torch
from numpy.typing import NDArray

from ckptstore.errors import CorruptCheckpointError
from ckptstore.stage.stager import (
    ArrayKind,
    CopyTask,
    DeviceCopies,
    LeafSpec,
    contiguous_chunks,
)

__all__ = ["TorchKind", "dtype_table", "numpy_dtype", "tensor_from_numpy", "torch_dtype"]


@functools.cache
def dtype_table() -> dict[torch.dtype, np.dtype[Any]]:
    """Every torch dtype ckptstore stores, and the numpy dtype with the same bytes.

    The one table of ckptstore: the manager, ``ckptstore.save``, multi-rank saves, the DCP
    writer and reader and the Lightning plug-in all store exactly these dtypes.
    """
    table: dict[torch.dtype, Any] = {
        torch.bool: np.bool_,
        torch.uint8: np.uint8,
        torch.int8: np.int8,
        torch.int16: np.int16,
        torch.int32: np.int32,
        torch.int64: np.int64,
        torch.uint16: np.uint16,
        torch.uint32: np.uint32,
        torch.uint64: np.uint64,
        torch.float16: np.float16,
        torch.float32: np.float32,
        torch.float64: np.float64,
        torch.complex64: np.complex64,
        torch.complex128: np.complex128,
        torch.bfloat16: ml_dtypes.bfloat16,
        torch.complex32: ml_dtypes.complex32,
        torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
        torch.float8_e5m2: ml_dtypes.float8_e5m2,
        torch.float8_e4m3fnuz: ml_dtypes.float8_e4m3fnuz,
        torch.float8_e5m2fnuz: ml_dtypes.float8_e5m2fnuz,
        torch.float8_e8m0fnu: ml_dtypes.float8_e8m0fnu,
    }
    return {k: np.dtype(v) for k, v in table.items()}


@functools.cache
def _inverse_table() -> dict[np.dtype[Any], torch.dtype]:
    return {v: k for k, v in dtype_table().items()}


def numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    """The numpy dtype with the same bytes as torch ``dtype``; ``TypeError`` if none."""
    try:
        return dtype_table()[dtype]
    except KeyError:
        known = ", ".join(str(d).removeprefix("torch.") for d in dtype_table())
        raise TypeError(
            f"torch dtype {dtype} has no byte-exact numpy equivalent; ckptstore stores {known}"
        ) from None


def torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    """The torch dtype with the same bytes as numpy ``dtype``; ``TypeError`` if none."""
    try:
        return _inverse_table()[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"numpy dtype {dtype} has no torch equivalent") from None


def _bytes_as_tensor(array: NDArray[Any], dtype: torch.dtype) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (C-contiguous, writable), reinterpreted as ``dtype``."""
    if array.dtype.type in _FROM_NUMPY and dtype_table()[dtype] == array.dtype:
        return torch.from_numpy(array)  # one call; the byte route below costs ~5x as much
    flat = torch.from_numpy(array.reshape(-1).view(np.uint8))
    return flat.view(dtype).view(array.shape)


#: numpy scalar types ``torch.from_numpy`` takes as they are (not the ml_dtypes ones).
_FROM_NUMPY = frozenset(
    [
        np.bool_,
        np.uint8,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
    ]
)


def tensor_from_numpy(array: NDArray[Any]) -> torch.Tensor:
    """A CPU tensor over ``array``'s memory when possible (copied if read-only or strided)."""
    if not array.flags.c_contiguous or not array.flags.writeable:
        array = np.array(array, order="C", copy=True)
    return _bytes_as_tensor(array, torch_dtype(array.dtype))


def _device_available(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        index = device.index or 0
        return bool(torch.cuda.is_available()) and index < torch.cuda.device_count()
    backend = getattr(torch, device.type, None)
    is_available = getattr(backend, "is_available", None)
    return bool(is_available()) if callable(is_available) else False


def _saved_placement(attrs: dict[str, Any], dtype: torch.dtype) -> tuple[torch.device, bool, bool]:
    """Device, ``requires_grad`` and ``parameter`` of a leaf as its manifest attributes say it
    was saved. They come from the checkpoint, so they are checked like any manifest field
    before torch sees them: a bad one is a :class:`~ckptstore.errors.CorruptCheckpointError`,
    never a ``RuntimeError`` from deep inside torch. A device this machine lacks is the CPU.
    """
    name = attrs.get("device", "cpu")
    bad_device = CorruptCheckpointError(
        f"leaf attribute device={str(name)[:80]!r} is not a torch device"
    )
    if type(name) is not str or len(name) > 64:
        raise bad_device
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise bad_device from None
    flags = {flag: attrs.get(flag, False) for flag in ("requires_grad", "parameter")}
    for flag, value in flags.items():
        if type(value) is not bool:
            raise CorruptCheckpointError(f"leaf attribute {flag}={value!r} is not a boolean")
    if flags["requires_grad"] and not (dtype.is_floating_point or dtype.is_complex):
        raise CorruptCheckpointError(
            f"leaf attribute requires_grad=true on a {dtype} tensor (only floating-point and "
            "complex tensors can require gradients)"
        )
    if not _device_available(device):
        device = torch.device("cpu")
    return device, flags["requires_grad"], flags["parameter"]


class TorchKind(ArrayKind):
    """``torch.Tensor`` and ``torch.nn.Parameter`` leaves (dense, strided layout)."""

    name = "torch"

    def owns(self, leaf: Any) -> bool:
        return isinstance(leaf, torch.Tensor)

    def __init__(self) -> None:
        # What a tensor's spec takes from its class, dtype, device, grad flag and layout, by
        # those five: on 20,000 small leaves, taking each tensor apart cost ~3 us a leaf of
        # every save (str() of the dtype and device, the refusals' checks, and
        # ``isinstance(t, Parameter)``, whose metaclass hook alone cost ~1 us).
        self._facts: dict[tuple[Any, ...], tuple[np.dtype[Any], dict[str, Any], bool]] = {}

    def spec(self, leaf: Any) -> LeafSpec:
        tensor: torch.Tensor = leaf
        key = (type(tensor), tensor.dtype, tensor.device, tensor.requires_grad, tensor.layout)
        facts = self._facts.get(key)
        if facts is None:
            facts = self._facts[key] = self._take_apart(tensor)
        dtype, attrs, pinned = facts
        # a dict of its own per leaf: a caller may add to a leaf's attrs
        return LeafSpec(dtype, tuple(tensor.shape), attrs.copy(), pinned=pinned)

    def _take_apart(self, tensor: torch.Tensor) -> tuple[np.dtype[Any], dict[str, Any], bool]:
        """The spec's facts common to every tensor of ``tensor``'s key, or its refusal."""
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(
                f"tensor subclass {type(tensor).__name__} is not staged natively (save a "
                "DTensor with ckptstore.distributed.save, which stores its shards as one "
                "global tensor, or with ckptstore's torch.distributed.checkpoint integration)"
            )
        if tensor.layout != torch.strided:
            raise TypeError(f"{tensor.layout} tensors are not supported; convert to dense first")
        if tensor.is_quantized:  # a property of the dtype (qint8, quint8...)
            raise TypeError("quantized tensors are not supported; dequantize first")
        if tensor.device.type == "meta":
            raise TypeError("meta tensors hold no data")
        attrs: dict[str, Any] = {
            "framework": self.name,
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "device": str(tensor.device),
            "requires_grad": bool(tensor.requires_grad),
        }
        if type(tensor) is torch.nn.Parameter:  # the only class with the flag, once refused
            attrs["parameter"] = True
        return numpy_dtype(tensor.dtype), attrs, tensor.is_cuda

    def copies(self, leaf: Any, dst: NDArray[Any], chunk_bytes: int) -> list[CopyTask]:
        nbytes = dst.nbytes
        if leaf.is_cpu and nbytes <= chunk_bytes:
            # Many small leaves: the task holds the leaf and its slot as they are, and its
            # batch makes the slot's tensor (no detach: the batch copies under no_grad).
            return [(nbytes, _HostCopy(dst, leaf))]
        src = leaf.detach()
        out = _bytes_as_tensor(dst, src.dtype)
        if src.is_cuda:
            # On the caller's current stream, whichever staging thread issues it: after the
            # caller's queued kernels, before its later ones, and on the stream the fence's
            # event is recorded on (a helper thread's current stream is the default one).
            stream = torch.cuda.current_stream(src.device)
            return [(0, _CudaCopy(stream, out, src, False))]
        if src.device.type != "cpu":
            return [(nbytes, _HostCopy(out, src.to("cpu")))]
        if nbytes <= chunk_bytes or not src.is_contiguous() or src.dim() == 0:
            return [(nbytes, _HostCopy(out, src))]
        flat_src, flat_out = src.view(-1), out.view(-1)
        size = src.element_size()
        return [
            ((stop - start) * size, _HostCopy(flat_out[start:stop], flat_src[start:stop]))
            for start, stop in contiguous_chunks(nbytes, size, chunk_bytes)
        ]

    def fence(self, leaves: list[Any]) -> Callable[[], None] | None:
        devices = {t.device for t in leaves if t.is_cuda}
        if not devices:
            return None
        events = []
        for device in devices:
            with torch.cuda.device(device):
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
                events.append(event)

        def wait() -> None:
            for event in events:
                event.synchronize()

        return wait

    def version(self, leaf: Any) -> int | None:
        tensor: torch.Tensor = leaf
        # is_cpu/is_cuda, not device.type: 0.07 against 0.45 us, for every leaf of a lazy save
        if not (tensor.is_cpu or tensor.is_cuda):
            return None  # copies() moves it to the host in the call anyway
        return int(tensor._version)

    def lost(self, leaf: Any, version: int) -> str | None:
        now = int(leaf._version)
        if now == version:
            return None
        return f"was modified in place (its version counter went from {version} to {now})"

    def device_copies(self, leaves: list[Any]) -> DeviceCopies | None:
        devices = {t.device for t in leaves if t.is_cuda}
        return _CudaCopies(devices) if devices else None

    def host_address(self, leaf: Any) -> int | None:
        tensor: torch.Tensor = leaf
        # a conjugate or negative view's bytes are not its values: torch's copy resolves it
        if tensor.is_cpu and tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg()):
            return int(tensor.data_ptr())
        return None

    def host_view(self, leaf: Any) -> NDArray[Any] | None:
        tensor: torch.Tensor = leaf.detach()
        if tensor.device.type != "cpu":
            return None
        tensor = tensor.contiguous()
        array: NDArray[Any] = tensor.view(-1).view(torch.uint8).numpy()
        return array.view(numpy_dtype(tensor.dtype)).reshape(tuple(tensor.shape))

    def rebuild(self, array: NDArray[Any], attrs: dict[str, Any], like: Any | None) -> Any:
        try:
            tensor = tensor_from_numpy(array)
        except TypeError as exc:
            if attrs.get("framework") != self.name:
                raise  # a caller asked for torch; not the checkpoint's fault
            # A tensor saved by torch always has a dtype torch has: the manifest lies.
            raise CorruptCheckpointError(f"a leaf saved as a torch tensor: {exc}") from None
        if like is not None:
            target: torch.Tensor = like
            if tensor.dtype != target.dtype:
                tensor = tensor.to(target.dtype)
            device, requires_grad = target.device, target.requires_grad
            parameter = isinstance(target, torch.nn.Parameter)
        elif attrs.get("framework") == self.name:
            device, requires_grad, parameter = _saved_placement(attrs, tensor.dtype)
        else:
            device, requires_grad, parameter = torch.device("cpu"), False, False
        if device.type != "cpu":
            tensor = tensor.to(device)
        if parameter:
            return torch.nn.Parameter(tensor, requires_grad=requires_grad)
        if requires_grad:
            tensor.requires_grad_(True)
        return tensor


class _CudaCopies(DeviceCopies):
    """The CUDA copies of one lazy snapshot (see the module docstring).

    Made in the caller's thread at ``save()``: each device's side stream waits for an event
    recorded on the caller's current stream now, so the copies read what the caller had
    queued, whichever thread issues them and whenever.
    """

    def __init__(self, devices: set[torch.device]) -> None:
        self._streams: dict[torch.device, tuple[Any, Any]] = {}
        self._done: dict[torch.device, Any] = {}
        for device in devices:
            with torch.cuda.device(device):
                caller = torch.cuda.current_stream(device)
                queued = torch.cuda.Event()  # type: ignore[no-untyped-call]
                queued.record(caller)
                side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                side.wait_event(queued)
                self._streams[device] = (caller, side)

    def owns(self, leaf: Any) -> bool:
        return bool(leaf.is_cuda)

    def copies(self, leaf: Any, dst: NDArray[Any]) -> list[CopyTask]:
        src: torch.Tensor = leaf.detach()
        side = self._streams[src.device][1]
        out = _bytes_as_tensor(dst, src.dtype)
        return [(0, _CudaCopy(side, out, src, True))]

    def issued(self) -> None:
        for device, (_, side) in self._streams.items():
            with torch.cuda.device(device):
                landed = torch.cuda.Event()  # type: ignore[no-untyped-call]
                landed.record(side)
                self._done[device] = landed

    def order(self) -> None:
        for device, (caller, _) in self._streams.items():
            caller.wait_event(self._done[device])

    def wait(self) -> None:
        for event in self._done.values():
            event.synchronize()


class _CudaCopy:
    """A copy of a CUDA tensor into its pinned slot, queued on ``stream``; the stager queues a
    batch of them with one ``torch._foreach_copy_`` per stream.

    Its task weighs 0 bytes: the device's copy engine moves the bytes, and the thread only
    queues the copy. A state of device tensors alone is then queued by the calling thread,
    with no helper woken; beside host copies, the batch goes to whichever staging thread is
    free once the host copies are handed out (the stream was taken in the caller's thread
    at ``copies``, so any thread queues it in the right place). Queued one by one from
    several threads (a stream context, a ``copy_`` and a GIL hand-off each), the 496 copies
    of the async benchmark's transformer held an H200 loop 35 ms, 3.6x the 10 ms a plain
    loop of ``copy_`` calls took to copy the same bytes.

    ``hold``: the stream is a side stream, so each source is marked as used by it
    (``record_stream``): the caching allocator does not hand its memory out while the copy
    reads it.
    """

    __slots__ = ("dst", "hold", "src", "stream")

    def __init__(self, stream: Any, dst: torch.Tensor, src: torch.Tensor, hold: bool) -> None:
        self.stream, self.dst, self.src, self.hold = stream, dst, src, hold

    def __call__(self) -> None:
        self.run_many([self])

    @staticmethod
    def run_many(copies: list[_CudaCopy]) -> None:
        batches: dict[tuple[Any, bool], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for copy in copies:
            dsts, srcs = batches.setdefault((copy.stream, copy.hold), ([], []))
            dsts.append(copy.dst)
            srcs.append(copy.src)
        for (stream, hold), (dsts, srcs) in batches.items():
            with torch.cuda.stream(stream), torch.no_grad():
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
                if hold:
                    for src in srcs:
                        src.record_stream(stream)


class _HostCopy:
    """A copy between CPU memory regions; the stager runs a batch of them with one call.

    ``dst`` is a tensor, or a leaf's arena slot (a numpy array) whose tensor is made when
    the copy runs, on whichever staging thread runs it.
    """

    __slots__ = ("dst", "src")

    def __init__(self, dst: torch.Tensor | NDArray[Any], src: torch.Tensor) -> None:
        self.dst, self.src = dst, src

    def target(self) -> torch.Tensor:
        dst = self.dst
        return dst if isinstance(dst, torch.Tensor) else _bytes_as_tensor(dst, self.src.dtype)

    def __call__(self) -> None:
        with torch.no_grad():
            self.target().copy_(self.src)

    @staticmethod
    def run_many(copies: list[_HostCopy]) -> None:
        # One call for the batch: the GIL is released once, so a staging thread is never
        # left waiting for it between tensors while the calling thread runs Python.
        with torch.no_grad():
            torch._foreach_copy_([c.target() for c in copies], [c.src for c in copies])
