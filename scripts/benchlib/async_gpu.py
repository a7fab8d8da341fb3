"""async-gpu: the ``async`` suite's training loop with the model, batch and state on a CUDA device.

The same children, systems and figures as the ``async`` suite (its description, below the
table of that section, says how each figure is measured), with these differences:

* the model is three 4096-wide linear layers over a batch of 8,192 (about 2.5 TFLOP a step in
  float32), its step synchronized at its end as a loop that reads its loss does, so the GPU
  and not Python sets the pace;
* the state (the ``1GiB`` and ``transformer`` workloads) lives on the GPU, so every save starts
  with a device-to-host copy: ``memcpy`` copies each tensor into pinned host buffers allocated
  before timing (``non_blocking``, one stream synchronization after the last copy), and that
  copy is the "one memcpy" the goals are stated against; ``bare``, the yardstick of CPU-only
  machines, is left out;
* ckptstore's eager save stages through its pooled pinned buffers with events, and its lazy
  save issues the copies on a side stream that waits for the caller's stream, fenced before
  each ``opt.step()`` (``mgr.fence()``); DCP's ``async_save`` stages with its default stager;
* Orbax is left out: it is a JAX library, and a torch CUDA state would reach it only through a
  device-to-host copy made outside its save;
* a save every 16 steps, 3 timed saves, so three rounds fit a lent GPU machine's few minutes.

Here the goals of the design hold as they are written for a GPU machine: an eager save loses
at most one memcpy of the state, a lazy one at most half of one.

On a machine without CUDA the suite measures nothing and leaves its section as it was.
"""

from __future__ import annotations

from benchlib import Context, Result, Suite
from benchlib.async_save import measure


def run(ctx: Context) -> list[Result]:
    import torch

    if not torch.cuda.is_available():
        ctx.options["skipped"] = "no CUDA device on this machine"
        return []
    ctx.options["device"] = torch.cuda.get_device_name()
    every, saves = (4, 2) if ctx.quick else (16, 3)
    return measure(ctx, "async-gpu", "cuda", every, saves)


SUITE = Suite(
    name="async-gpu",
    title="Async save on a GPU: time a training loop loses per save",
    run=run,
    description=__doc__.split("\n\n", 1)[1].strip(),
)
