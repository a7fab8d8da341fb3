"""resume: a training loop resumed from SeaweedFS, with a full restore and with a streaming
restore (``restore(step, stream=True)``: :mod:`ckptstore.pipeline.streaming`).

The state is the transformer workload of :mod:`benchlib.workloads` as a real torch model (a
module whose ``state_dict`` has the workload's names and shapes: embedding, 10 layers of width
512, head) and its ``torch.optim.Adam`` state after one step: 456 MiB in 496 tensors, two
thirds of it Adam's moments. It is saved once by a ``CheckpointManager`` on a SeaweedFS this
suite starts (``weed mini`` on loopback ports, S3 over ``http://``, sharing the 2 cores with
the client).

Each run builds a fresh model and optimizer (untimed, as a job does before it restores), drops
SeaweedFS's data files from the page cache, then times from the ``restore`` call:

* **full restore**: ``restore(step)``, ``model.load_state_dict``, ``opt.load_state_dict``:
  the time until training can start (**restored**), then one forward and backward pass
  (**first forward/backward**) and one ``opt.step()``;
* **streaming restore**: ``restore(step, stream=True)``, which returns once every leaf but
  the optimizer's state is in place, the same two ``load_state_dict`` calls, the forward and
  backward pass (**first forward/backward**), then ``opt.step()``, whose pre-hook waits for
  the rest (**first optimizer step**).

The two systems alternate in every round. After the step, the parameters of both runs of a
round are compared bit for bit: the streamed resume must train exactly as the full one.
Goal (issue 32): streaming's first forward/backward <= 0.4x the full restore's time, the median
of ``repeat`` runs. The forward/backward pass alone (batch ``BATCH`` x ``SEQUENCE`` tokens, the
model already in memory) is measured in the same rounds and reported beside it.

On this machine the accelerator is the CPU: the forward and backward pass runs on the same 2
cores as the background reads, their checksums and the SeaweedFS server, so whatever the
background part costs the cores is taken from the pass (on a GPU the pass runs on the device,
and the host's cores are left to the reads).
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

from benchlib import Context, Result, Suite, cpu_time, evict, torch_tensors, workloads
from ckptstore.manager import CheckpointManager
from ckptstore.testing.servers import SeaweedFS

BUCKET = "bench-resume"
WORKLOAD = "transformer + Adam (torch)"
TARGET = "SeaweedFS http"
FULL, STREAMED, ALONE = "full restore", "streaming restore", "forward/backward alone"
BATCH, SEQUENCE = 2, 32


def _model(quick: bool) -> Any:
    """A transformer whose ``state_dict`` has the names and shapes of the workload's model."""
    import torch
    from torch import nn

    layers, width, vocab = (2, 256, 2048) if quick else (10, 512, 8192)
    heads = 8

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width)
            self.out = nn.Linear(width, width)

        def forward(self, x: Any) -> Any:
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, heads, width // heads).unbind(2)
            y = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            return self.out(y.transpose(1, 2).reshape(b, t, width))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(width, 4 * width)
            self.fc2 = nn.Linear(4 * width, width)

        def forward(self, x: Any) -> Any:
            return self.fc2(nn.functional.gelu(self.fc1(x)))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.mlp = Attention(), MLP()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)

        def forward(self, x: Any) -> Any:
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, tokens: Any) -> Any:
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    return Transformer()


def _batch(quick: bool) -> tuple[Any, Any]:
    import torch

    vocab = 2048 if quick else 8192
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (BATCH, SEQUENCE + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _forward_backward(model: Any, batch: tuple[Any, Any]) -> None:
    import torch

    tokens, targets = batch
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()


def _fresh(quick: bool) -> tuple[Any, Any]:
    import torch

    model = _model(quick)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _trained_state(quick: bool) -> dict[str, Any]:
    """The workload's weights in the torch model, and Adam's state after one step."""
    import torch

    model, opt = _fresh(quick)
    weights = workloads.transformer(quick)["model"]
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(torch.from_numpy(weights[name]))
    _forward_backward(model, _batch(quick))
    opt.step()
    opt.zero_grad()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}


def _resume(mgr: CheckpointManager, step: int, quick: bool, *, stream: bool) -> dict[str, Any]:
    """One timed resume; returns its timestamps (seconds from the restore call) and the
    parameters after the first optimizer step."""
    model, opt = _fresh(quick)
    batch = _batch(quick)
    c0, t0 = cpu_time(), time.perf_counter()
    state = mgr.restore(step, stream=stream)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    loaded = time.perf_counter() - t0
    _forward_backward(model, batch)
    first = time.perf_counter() - t0
    opt.step()  # a streaming restore's rest is waited for here, by the pre-hook
    stepped = time.perf_counter() - t0
    cpu = cpu_time() - c0
    params = [p.detach().clone() for p in model.parameters()]
    return {"loaded": loaded, "first": first, "step": stepped, "cpu": cpu, "params": params}


def _alone(quick: bool) -> float:
    model, _ = _fresh(quick)
    batch = _batch(quick)
    _forward_backward(model, batch)  # warm
    model.zero_grad()
    t0 = time.perf_counter()
    _forward_backward(model, batch)
    return time.perf_counter() - t0


def run(ctx: Context) -> list[Result]:
    import torch

    state = _trained_state(ctx.quick)
    nbytes = sum(t.numel() * t.element_size() for t in torch_tensors(state))
    runs: dict[str, list[dict[str, Any]]] = {FULL: [], STREAMED: []}
    alone: list[float] = []
    exact: list[bool] = []
    with SeaweedFS(ctx.workdir / "seaweedfs") as server:
        server.create_bucket(BUCKET)
        url = (
            f"s3://{BUCKET}/resume-{uuid.uuid4().hex[:8]}"
            f"?endpoint_url={server.s3_endpoint}&anonymous=true"
        )
        with CheckpointManager(url) as mgr:
            mgr.save(1, state)
            mgr.wait_until_finished()
        del state
        data = [p for p in (server.workdir / "data").rglob("*") if p.is_file()]
        with CheckpointManager(url) as mgr:
            for _ in range(ctx.repeat):
                outcome = {}
                for system in (FULL, STREAMED):
                    evict(data)
                    outcome[system] = _resume(mgr, 1, ctx.quick, stream=system == STREAMED)
                    runs[system].append(outcome[system])
                exact.append(
                    all(
                        torch.equal(a, b)
                        for a, b in zip(
                            outcome[FULL]["params"], outcome[STREAMED]["params"], strict=True
                        )
                    )
                )
                alone.append(_alone(ctx.quick))
    rows: list[Result] = []

    def row(system: str, op: str, key: str, notes: str = "") -> float:
        values = [r[key] for r in runs[system]]
        rows.append(
            Result(
                "resume",
                WORKLOAD,
                TARGET,
                system,
                op,
                nbytes,
                statistics.median(values),
                values,
                statistics.median(r["cpu"] for r in runs[system]),
                notes=notes,
            )
        )
        return statistics.median(values)

    full_loaded = row(FULL, "restored (load_state_dict done)", "loaded")
    full_first = row(FULL, "first forward/backward", "first")
    row(FULL, "first optimizer step", "step")
    streamed_loaded = row(STREAMED, "returned (load_state_dict done)", "loaded")
    streamed_first = row(STREAMED, "first forward/backward", "first")
    row(STREAMED, "first optimizer step", "step")
    rows.append(
        Result(
            "resume",
            WORKLOAD,
            TARGET,
            ALONE,
            "forward/backward",
            0,
            statistics.median(alone),
            alone,
            0.0,
        )
    )
    ratios = [s["first"] / f["loaded"] for f, s in zip(runs[FULL], runs[STREAMED], strict=True)]
    ctx.options["summary"] = (
        f"- streaming first forward/backward / full restore: {streamed_first / full_loaded:.2f}x "
        f"(medians; per round {', '.join(f'{r:.2f}' for r in ratios)}; goal <= 0.4x); "
        f"streaming returned after {streamed_loaded / full_loaded:.2f}x of the full restore, "
        f"and that plus the forward/backward pass alone is "
        f"{(streamed_loaded + statistics.median(alone)) / full_loaded:.2f}x (what the first "
        f"forward/backward would take if the background reads cost it nothing); "
        f"first forward/backward streaming / full {streamed_first / full_first:.2f}x; "
        f"first optimizer step bit-exact with the full restore's in "
        f"{sum(exact)} of {len(exact)} rounds"
    )
    return rows


SUITE = Suite(
    "resume",
    "Resume: a training loop restored from SeaweedFS, full and streaming",
    run,
    description=__doc__ or "",
)
