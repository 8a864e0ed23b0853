"""Error-compensated 1-bit allreduce (docs/zero-one-adam.md, "1-bit allreduce").

Two passes over a flat buffer padded to a multiple of 8*n:
  worker  y = x + e_w; send sign(y) and s_w = RMS(y); e_w <- y - s_w*sign(y)
  pass 1  all_to_all: rank j gets chunk j of every rank's signs and their scales
  server  c = mean_i(s_i*sign_i) + e_s; send sign(c) and s_s = RMS(c); e_s <- c - s_s*sign(c)
  pass 2  all_gather of the server signs and scales; every rank unpacks the same average
Each segment on the wire is the packed signs of one chunk followed by its fp32 scale, so a call is
exactly two collectives. Padding carries no value: it is excluded from the scales and its error
is kept at zero, so the result does not depend on how much padding a world size needs.

Speed: the residual e <- y - s*sign(y) needs s, which needs all of y, so done eagerly it costs a
second pass over memory. Instead each buffer keeps y and the signs and scale it sent, and the
subtraction is folded into the next call's single pass (the signs are read back from the send
buffers, which the collectives leave untouched). `worker_error`, `server_error` and the state
dict give the materialised errors.
"""

import torch
import torch.distributed as dist

from zoa_train.comm.collectives import default_ledger, group_size_rank
from zoa_train.comm.ledger import CommLedger
from zoa_train.comm.packing import BLOCK, pack_signs, unpack_signs

_SCALE_BYTES = 4
# torch 2.14 renamed all_gather_into_tensor; keep older releases working.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def onebit_layout(numel: int, world_size: int) -> tuple[int, int, int]:
    """(padded length, chunk per rank, bytes per wire segment) of a 1-bit allreduce of `numel`
    elements: padded to a multiple of 8n, a segment is a chunk's packed signs plus its fp32 scale.
    All zero when there is nothing to send (one rank or no elements)."""
    if world_size < 2 or numel <= 0:
        return 0, 0, 0
    padded = -(-numel // (8 * world_size)) * (8 * world_size)
    chunk = padded // world_size
    return padded, chunk, chunk // 8 + _SCALE_BYTES


class OneBitAllReduce:
    """Averages a fixed-size flat buffer over a process group with 1-bit error-compensated compression.

    Owns the worker error (padded length, fp32) and the server error (this rank's chunk, fp32) and
    all communication buffers, allocated once. Math is fp32 whatever the input dtype. With a world
    size of 1, `op` returns its input unchanged and sends nothing, and `exchange` returns the
    accumulator exactly.
    """

    def __init__(
        self,
        numel: int,
        group=None,
        device: torch.device | str | None = None,
        ledger: CommLedger | None = None,
        block_size: int = BLOCK,
    ):
        self.numel = int(numel)
        self.group = group
        self.world_size, self.rank = group_size_rank(group)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.ledger = ledger if ledger is not None else default_ledger()
        self.block_size = max(8, block_size // 8 * 8)
        n = self.world_size
        self.padded_numel, self.chunk, self._segment = onebit_layout(self.numel, n)
        active = self.padded_numel > 0
        self._packed_chunk = self.chunk // 8
        self._chunk_valid = min(max(self.numel - self.rank * self.chunk, 0), self.chunk)

        f32, u8 = dict(dtype=torch.float32, device=self.device), dict(dtype=torch.uint8, device=self.device)
        # y of the last call (worker) and c of the last call (server); errors once the pending
        # subtraction of scale*sign is applied.
        self._worker = torch.zeros(self.padded_numel if active else self.numel, **f32)
        self._server = torch.zeros(self.chunk, **f32)
        self._pending = False
        segments = n * self._segment if active else 0
        self._send = torch.zeros(segments, **u8)
        self._recv = torch.empty(segments, **u8)
        self._gathered = torch.empty(segments, **u8)
        self._mine = torch.zeros(self._segment if active else 0, **u8)
        self._work = torch.empty(min(self.block_size, self.padded_numel), **f32)

    @property
    def bytes_per_call(self) -> int:
        """Bytes this rank sends in one call: (n-1) segments in each pass."""
        return 2 * (self.world_size - 1) * self._segment if self.padded_numel else 0

    @property
    def accumulator(self) -> torch.Tensor:
        """A view of numel elements that the next `exchange()` compresses (plus the carried error).

        Adding into it between calls is the same as passing the sum to `op`; optimizers use it to
        accumulate their update without a buffer of their own.
        """
        return self._worker[: self.numel]

    @property
    def worker_error(self) -> torch.Tensor:
        """The worker error e_w (padded length), materialised as a new tensor."""
        if not self._pending:
            return self._worker.clone()
        return self._materialised(self._worker, self._sent_signs(), self.numel)

    @property
    def server_error(self) -> torch.Tensor:
        """The server error e_s of this rank's chunk, materialised as a new tensor."""
        return self._materialised(self._server, self._mine, self._chunk_valid)

    def op(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average `tensor` in place over the group (error-compensated) and return it."""
        if tensor.numel() != self.numel:
            raise ValueError(f"OneBitAllReduce was built for {self.numel} elements, got {tensor.numel()}")
        if self.padded_numel == 0:
            return tensor
        if not tensor.is_contiguous():
            raise ValueError("OneBitAllReduce.op needs a contiguous tensor")
        flat = tensor.view(-1)
        self.exchange(out=flat, addend=flat)
        return tensor

    def exchange(self, out: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
        """Compress accumulator + error (+ addend), run both passes, write the average to `out`."""
        if self.padded_numel == 0:  # one rank: the average is the input itself
            torch.add(self._worker, addend, out=out) if addend is not None else out.copy_(self._worker)
            self._worker.zero_()
            return out
        n, chunk, packed_chunk, numel = self.world_size, self.chunk, self._packed_chunk, self.numel
        send = self._send.view(n, self._segment)

        # Worker: y = e_w + addend, packed into one segment per destination chunk.
        def worker_block(start: int, block: torch.Tensor) -> None:
            stop = min(start + block.numel(), numel)
            if addend is not None and stop > start:
                block[: stop - start].add_(addend[start:stop])

        sum_squares = sum(
            self._fold_and_pack(self._worker, j * chunk, (j + 1) * chunk, send[j], numel, worker_block)
            for j in range(n)
        )
        scale = torch.sqrt(sum_squares / numel)
        send[:, packed_chunk:].copy_(scale.reshape(1).view(torch.uint8))

        # Pass 1: rank j receives chunk j of everyone.
        dist.all_to_all_single(self._recv, self._send, group=self.group)

        # Server: c = e_s + mean_i(s_i*sign_i) over this rank's chunk, packed.
        recv = self._recv.view(n, self._segment)
        scales = recv[:, packed_chunk:].contiguous().view(torch.float32).reshape(n) / n

        def server_block(start: int, block: torch.Tensor) -> None:
            work = self._work[: block.numel()]
            for i in range(n):
                unpack_signs(recv[i, start // 8 : (start + block.numel()) // 8], block.numel(), scales[i], out=work)
                block.add_(work)

        valid = max(self._chunk_valid, 1)
        server_scale = torch.sqrt(self._fold_and_pack(self._server, 0, chunk, self._mine, self._chunk_valid, server_block) / valid)
        self._mine[packed_chunk:].copy_(server_scale.reshape(1).view(torch.uint8))
        self._pending = True

        # Pass 2: everyone gathers every server chunk and unpacks the same average.
        _all_gather_single(self._gathered, self._mine, group=self.group)
        gathered = self._gathered.view(n, self._segment)
        server_scales = gathered[:, packed_chunk:].contiguous().view(torch.float32).reshape(n)
        for j in range(n):
            first, last = j * chunk, min((j + 1) * chunk, numel)
            if last > first:
                unpack_signs(gathered[j, :packed_chunk], last - first, server_scales[j], out=out[first:last])

        self.ledger.record("onebit_allreduce", payload_bits=1, elements=numel, bytes_sent=self.bytes_per_call, calls=2)
        return out

    def _fold_and_pack(self, values, first, last, segment, valid, add_input) -> torch.Tensor:
        """One pass over values[first:last], block by block while each block is in cache:
        apply the pending residual (values -= last scale * last signs, read from `segment`),
        add_input(offset, block), zero what lies past `valid`, pack the signs into `segment`
        and sum the squares. Returns the sum of squares."""
        packed, pending_scale = segment[: self._packed_chunk], _scale_of(segment)
        sum_squares = torch.zeros((), dtype=torch.float32, device=values.device)
        for start in range(first, last, self.block_size):
            block = values[start : min(start + self.block_size, last)]
            signs = packed[(start - first) // 8 : (start - first + block.numel()) // 8]
            if self._pending:
                block.sub_(unpack_signs(signs, block.numel(), pending_scale, out=self._work[: block.numel()]))
            add_input(start, block)
            if start + block.numel() > valid:
                block[max(valid - start, 0) :].zero_()
            pack_signs(block, out=signs)
            sum_squares += torch.dot(block, block)
        return sum_squares

    def _sent_signs(self) -> torch.Tensor:
        """The worker's last packed signs as one contiguous run, with the scale appended."""
        send = self._send.view(self.world_size, self._segment)
        return torch.cat([send[:, : self._packed_chunk].reshape(-1), send[0, self._packed_chunk :]])

    def _materialised(self, values: torch.Tensor, segment: torch.Tensor, valid: int) -> torch.Tensor:
        error = values.clone()
        if self._pending:
            error -= unpack_signs(segment[:-_SCALE_BYTES], error.numel(), _scale_of(segment))
            error[valid:] = 0
        return error

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
        self._worker.copy_(state["worker_error"])
        self._server.copy_(state["server_error"])
        self._pending = False


def _scale_of(segment: torch.Tensor) -> torch.Tensor:
    """The fp32 scale stored in the last 4 bytes of a segment (copied out: the bytes may be unaligned)."""
    return segment[-_SCALE_BYTES:].clone().view(torch.float32).reshape(())
