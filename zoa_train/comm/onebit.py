"""Error-compensated 1-bit allreduce (docs/zero-one-adam.md, "1-bit allreduce").

Two passes over a flat buffer padded to a multiple of 8*n:
  worker  y = x + e_w; send sign(y) and s_w = RMS(y); e_w <- y - s_w*sign(y)
  pass 1  all_to_all: rank j gets chunk j of every rank's signs and their scales
  server  c = mean_i(s_i*sign_i) + e_s; send sign(c) and s_s = RMS(c); e_s <- c - s_s*sign(c)
  pass 2  all_gather of the server signs and scales; every rank unpacks the same average
Each segment on the wire is the packed signs of one chunk followed by its fp32 scale, so a call is
exactly two collectives. Padding carries no value: it is excluded from the scales and its error
is kept at zero, so the result does not depend on how much padding a world size needs.
"""

import math

import torch
import torch.distributed as dist

from zoa_train.comm.collectives import default_ledger, group_size_rank
from zoa_train.comm.ledger import CommLedger
from zoa_train.comm.packing import pack_signs, unpack_signs

_SCALE_BYTES = 4
# torch 2.14 renamed all_gather_into_tensor; keep older releases working.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class OneBitAllReduce:
    """Averages a fixed-size flat buffer over a process group with 1-bit error-compensated compression.

    Owns the worker error (padded length, fp32) and the server error (this rank's chunk, fp32) and
    all communication buffers, allocated once. Math is fp32 whatever the input dtype. With a world
    size of 1, `op` returns its input unchanged and sends nothing.
    """

    def __init__(
        self,
        numel: int,
        group=None,
        device: torch.device | str | None = None,
        ledger: CommLedger | None = None,
        block_size: int = 1 << 20,
    ):
        self.numel = int(numel)
        self.group = group
        self.world_size, self.rank = group_size_rank(group)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.ledger = ledger if ledger is not None else default_ledger()
        self.block_size = max(8, block_size // 8 * 8)
        n = self.world_size
        active = n > 1 and self.numel > 0
        self.padded_numel = -(-self.numel // (8 * n)) * (8 * n) if active else 0
        self.chunk = self.padded_numel // n
        self._packed_chunk = self.chunk // 8
        self._segment = self._packed_chunk + _SCALE_BYTES
        self._chunk_valid = min(max(self.numel - self.rank * self.chunk, 0), self.chunk)

        f32, u8 = dict(dtype=torch.float32, device=self.device), dict(dtype=torch.uint8, device=self.device)
        self.worker_error = torch.zeros(self.padded_numel, **f32)
        self.server_error = torch.zeros(self.chunk, **f32)
        segments = n * self._segment if active else 0
        self._send = torch.empty(segments, **u8)
        self._recv = torch.empty(segments, **u8)
        self._gathered = torch.empty(segments, **u8)
        self._mine = torch.empty(self._segment if active else 0, **u8)
        self._work = torch.empty(min(self.block_size, self.padded_numel), **f32)

    @property
    def bytes_per_call(self) -> int:
        """Bytes this rank sends in one call: (n-1) segments in each pass."""
        return 2 * (self.world_size - 1) * self._segment if self.padded_numel else 0

    def op(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average `tensor` in place over the group (error-compensated) and return it."""
        if tensor.numel() != self.numel:
            raise ValueError(f"OneBitAllReduce was built for {self.numel} elements, got {tensor.numel()}")
        if self.padded_numel == 0:
            return tensor
        if not tensor.is_contiguous():
            raise ValueError("OneBitAllReduce.op needs a contiguous tensor")
        flat = tensor.view(-1)
        self.worker_error[: self.numel].add_(flat)
        self.exchange(out=flat)
        return tensor

    def exchange(self, out: torch.Tensor) -> torch.Tensor:
        """Run both passes on the input already added into `worker_error`; write the average to `out`.

        `op` is the usual entry point. Optimizers that accumulate their buffer straight into
        `worker_error` (saving a copy of the model's size) call this directly.
        """
        n, packed_chunk = self.world_size, self._packed_chunk
        y = self.worker_error

        # Worker: compress y into one segment per destination chunk, keep the residual as error.
        scale = torch.linalg.vector_norm(y) / math.sqrt(self.numel)
        send = self._send.view(n, self._segment)
        send[:, packed_chunk:].copy_(scale.reshape(1).view(torch.uint8))
        for j in range(n):
            self._compress_(y[j * self.chunk : (j + 1) * self.chunk], scale, send[j, :packed_chunk])
        y[self.numel :].zero_()

        # Pass 1: rank j receives chunk j of everyone.
        dist.all_to_all_single(self._recv, self._send, group=self.group)

        # Server: average the n compressed chunks into the server error, then compress that.
        recv = self._recv.view(n, self._segment)
        scales = recv[:, packed_chunk:].contiguous().view(torch.float32).reshape(n) / n
        c = self.server_error
        for start in range(0, self.chunk, self.block_size):
            stop = min(start + self.block_size, self.chunk)
            work = self._work[: stop - start]
            for i in range(n):
                unpack_signs(recv[i, start // 8 : stop // 8], stop - start, scales[i], out=work)
                c[start:stop].add_(work)
        valid = self._chunk_valid
        c[valid:].zero_()
        server_scale = torch.linalg.vector_norm(c) / math.sqrt(max(valid, 1))
        self._mine[packed_chunk:].copy_(server_scale.reshape(1).view(torch.uint8))
        self._compress_(c, server_scale, self._mine[:packed_chunk])
        c[valid:].zero_()

        # Pass 2: everyone gathers every server chunk and unpacks the same average.
        _all_gather_single(self._gathered, self._mine, group=self.group)
        gathered = self._gathered.view(n, self._segment)
        server_scales = gathered[:, packed_chunk:].contiguous().view(torch.float32).reshape(n)
        for j in range(n):
            first = j * self.chunk
            for start in range(first, min(first + self.chunk, self.numel), self.block_size):
                stop = min(start + self.block_size, first + self.chunk, self.numel)
                packed = gathered[j, (start - first) // 8 : (stop - first + 7) // 8]
                unpack_signs(packed, stop - start, server_scales[j], out=out[start:stop])

        self.ledger.record("onebit_allreduce", payload_bits=1, elements=self.numel, bytes_sent=self.bytes_per_call, calls=2)
        return out

    def _compress_(self, values: torch.Tensor, scale: torch.Tensor, packed: torch.Tensor) -> None:
        """packed <- signs of values; values <- values - scale*sign(values), block by block to stay in cache."""
        for start in range(0, values.numel(), self.block_size):
            block = values[start : start + self.block_size]
            signs = packed[start // 8 : (start + block.numel()) // 8]
            pack_signs(block, out=signs)
            block.sub_(unpack_signs(signs, block.numel(), scale, out=self._work[: block.numel()]))

    def state_dict(self) -> dict:
        return {
            "numel": self.numel,
            "world_size": self.world_size,
            "worker_error": self.worker_error,
            "server_error": self.server_error,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["world_size"] != self.world_size or state["numel"] != self.numel:
            raise ValueError(
                f"1-bit allreduce state is for {state['numel']} elements on {state['world_size']} ranks, "
                f"this one is for {self.numel} on {self.world_size}"
            )
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])
