"""Batches on the training device one step ahead: on CUDA the next batch is pinned and copied on a side
stream while the current step computes (a `non_blocking` copy from pageable memory would be synchronous)."""

import torch


class DevicePrefetcher:
    """Wraps a task's endless loader (with state_dict/load_state_dict) and its `to_device`.

    One batch is always fetched ahead. `state_dict` is the loader's position before that look-ahead
    batch, i.e. after the batches returned so far, so a checkpoint resumes exactly as without prefetching.
    On the CPU nothing is copied or pinned: the look-ahead only keeps the code path the same everywhere.
    """

    def __init__(self, loader, to_device, device: torch.device):
        self.loader, self.to_device, self.device = loader, to_device, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._ahead = None  # the next batch, already on (or on its way to) the device
        self._position = None  # the loader's state before the look-ahead batch

    def __iter__(self) -> "DevicePrefetcher":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._ahead is None:
            self._fetch()
        batch = self._ahead
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for tensor in batch.values():
                tensor.record_stream(current)  # the side stream's allocator must not reuse it early
        self._fetch()
        return batch

    def _fetch(self) -> None:
        self._position = self.loader.state_dict()
        host = next(self.loader)
        if not self.cuda:
            self._ahead = self.to_device(host, self.device)
            return
        host = {k: v.pin_memory() for k, v in host.items()}
        with torch.cuda.stream(self.stream):
            self._ahead = self.to_device(host, self.device)

    def state_dict(self) -> dict:
        return self._position if self._ahead is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._ahead = self._position = None
