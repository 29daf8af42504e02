"""Host memory for the KV blocks of paused sequences: swap out, swap back in.

With LoRA slot time-slicing, a sequence paused for its adapter's turn keeps its KV blocks on
the device while it waits (services/engine/scheduler.py). Under a skewed adapter mix hundreds of
them can wait at once, and their blocks fill the cache: new requests then wait for blocks, or a
paused sequence is preempted and later recomputes its whole context. With swap space, the
scheduler instead moves a paused sequence's blocks to host memory when the cache is short
(`HostBlocks` in services/engine/swap_space.py picks where: one contiguous extent per
sequence), and back when its adapter has a slot again; no work is lost, each way costs the
blocks' bytes over the host link.

`KVSwapper` does the copies on the KV cache's tensors: with the cache's layers views of one
tensor (`KVCache.stacked`), a sequence's blocks of every layer move in one gather (or scatter)
and one copy to (or from) host memory laid out [host block, layer, key/value, ...]; otherwise
a copy per layer's keys and values. They are issued when the scheduler's plan is made, before
the step that plan launches: the gather of a swap-out on the device's current stream, after
every step already issued (the last one that wrote its blocks) and before the step that
reuses them; a swap-in's scatter before the sequence's next step, which is planned later. On a
GPU the host side is pinned and, with a stacked cache, the transfers over the host link (a few
ms for a long sequence) run on a side stream: a swap-out's from the gathered copy, a swap-in's
beside the step in flight, its scatter waiting for it on the current stream. The host thread
never waits for them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.engine.scheduler import SchedulerOutput


class KVSwapper:
    """Copies KV blocks between the cache's per-layer tensors and a host mirror of them."""

    def __init__(
        self,
        layers: Seq[tuple[torch.Tensor, torch.Tensor]],
        num_host_blocks: int,
        stacked: torch.Tensor | None = None,
    ) -> None:
        """`stacked`: the tensor [layers, 2, blocks, ...] that `layers` are views of, if any."""
        # Copied as bytes: every KV element type moves the same way (index_copy has no float8).
        self._layers = [tensor.view(torch.uint8) for pair in layers for tensor in pair]
        self.device = self._layers[0].device
        pin = self.device.type == "cuda"
        self._stacked = stacked.view(torch.uint8) if stacked is not None else None
        if self._stacked is not None:
            layout = self._stacked.shape
            self._host = [
                torch.empty(
                    (num_host_blocks, *layout[:2], *layout[3:]), dtype=torch.uint8, pin_memory=pin
                )
            ]
        else:
            self._host = [
                torch.empty((num_host_blocks, *tensor.shape[1:]), dtype=torch.uint8, pin_memory=pin)
                for tensor in self._layers
            ]
        self.num_blocks = num_host_blocks
        self.nbytes = sum(tensor.nbytes for tensor in self._host)
        # A GPU's transfers over the host link run on a stream of their own (module docstring).
        self._side = torch.cuda.Stream(self.device) if pin and self._stacked is not None else None

    def apply(self, plan: SchedulerOutput) -> None:
        """Issue a plan's copies: swap-outs first (a swap-in of the same plan may reuse the
        device blocks they free), then swap-ins."""
        for device_blocks, start in plan.swap_out:
            self.swap_out(device_blocks, start)
        for start, device_blocks in plan.swap_in:
            self.swap_in(start, device_blocks)

    def swap_out(self, device_blocks: list[int], start: int) -> None:
        """Copy `device_blocks` (in order) to host blocks start, start + 1, ..."""
        index = torch.tensor(device_blocks, dtype=torch.long).to(self.device, non_blocking=True)
        end = start + len(device_blocks)
        if self._stacked is not None:  # [layers, 2, n, ...] -> [n, layers, 2, ...], one copy
            rows = self._stacked.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous()
            target = self._host[0][start:end]
            if self._side is None:
                target.copy_(rows)
                return
            # The gather above is in order with the steps; the slow part leaves from its copy.
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                target.copy_(rows, non_blocking=True)
            rows.record_stream(self._side)
            return
        for tensor, host in zip(self._layers, self._host, strict=True):
            host[start:end].copy_(tensor.index_select(0, index), non_blocking=True)

    def swap_in(self, start: int, device_blocks: list[int]) -> None:
        """Copy host blocks start, start + 1, ... back into `device_blocks` (in order)."""
        index = torch.tensor(device_blocks, dtype=torch.long).to(self.device, non_blocking=True)
        end = start + len(device_blocks)
        if self._stacked is not None:
            source = self._host[0][start:end]
            if self._side is None:
                rows = source.to(self.device)
            else:  # in over the link beside the step in flight, then scattered in order
                with torch.cuda.stream(self._side):
                    rows = source.to(self.device, non_blocking=True)
                    landed = torch.cuda.Event()
                    landed.record(self._side)
                current = torch.cuda.current_stream(self.device)
                current.wait_event(landed)
                rows.record_stream(current)
            self._stacked.index_copy_(2, index, rows.permute(1, 2, 0, 3, 4, 5))
            return
        for tensor, host in zip(self._layers, self._host, strict=True):
            tensor.index_copy_(0, index, host[start:end].to(self.device, non_blocking=True))
