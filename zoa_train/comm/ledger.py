"""CommLedger: what every collective issued through zoa_train.comm cost, per step and in total.

Conventions (docs/algorithm.md, "Counting"): nominal bits per parameter per step are the
payload bits of each element sent (32 fp32, 16 fp16/bf16, 1 for a 1-bit round, 0 for a local step),
summed over the step's collectives and divided by the number of parameters; a round is a step with
any communication over the slow link (FSDP2's collectives inside a node make no step a round); bytes are what this rank sends, scales, padding and both passes
included, under the standard algorithm of each collective (ring for allreduce and all-gather).

Link classes: a collective over ranks of one node (the node-aware 1-bit sync's reduce-scatter and
all-gather) is recorded as `link="intra"` and kept apart; everything else counts as crossing the
slow link between nodes (a flat collective over the world does, on any cluster of more than one
node). So `bits_per_param` and `bytes_sent` are what this rank puts on the slow link, and
`intra_bits_per_param` and `intra_bytes_sent` what it sends inside its node.

Time of bucketed rounds (zoa_train/comm/buckets.py): `round_seconds` is what their rounds took where
they ran, `exposed_seconds` what the optimizer's step() spent waiting for them. In step() the two are
equal; overlapped with backward, the difference is what backward hid. Timings, not counts: they are
not saved in checkpoints.
"""

import threading
from dataclasses import dataclass, field


@dataclass
class StepComm:
    """Communication of one optimizer step on this rank."""

    bits_per_param: float
    round: bool
    bytes_sent: int
    calls: int
    intra_bits_per_param: float = 0.0
    intra_bytes_sent: int = 0


LINKS = ("inter", "intra")


@dataclass
class CommLedger:
    """Running record of collectives. `num_params` is the denominator of bits per parameter."""

    num_params: int = 0
    steps: int = 0
    rounds: int = 0
    bytes_sent: int = 0
    calls: int = 0
    payload_bits: int = 0  # sum over all steps of payload bits x elements
    by_kind: dict = field(default_factory=dict)
    intra_bytes_sent: int = 0  # inside the node (link="intra")
    intra_payload_bits: int = 0
    round_seconds: float = field(default=0.0, compare=False)
    exposed_seconds: float = field(default=0.0, compare=False)
    _step_bits: int = 0
    _step_bytes: int = 0
    _step_calls: int = 0
    _step_intra_bits: int = 0
    _step_intra_bytes: int = 0
    _step_inter_calls: int = 0
    # records may come from a collective's background thread (zoa_train/comm/buckets.py)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, kind: str, payload_bits: int, elements: int, bytes_sent: int, calls: int = 1, in_step: bool = True, link: str = "inter") -> None:
        """Record one logical collective (`calls` underlying collective calls) in the current step,
        or with `in_step=False` (a sync outside the optimizer's steps, e.g. before a checkpoint)
        straight into the totals: it adds bits and bytes but makes no step a round. `link`: "inter"
        (the slow link, the default) or "intra" (among the ranks of one node)."""
        if link not in LINKS:
            raise ValueError(f"link must be one of {LINKS}, got {link!r}")
        with self._lock:
            self._record(kind, payload_bits, elements, bytes_sent, calls, in_step, link == "intra")

    def _record(self, kind: str, payload_bits: int, elements: int, bytes_sent: int, calls: int, in_step: bool, intra: bool) -> None:
        if in_step:
            self._step_calls += calls
            if intra:
                self._step_intra_bits += payload_bits * elements
                self._step_intra_bytes += bytes_sent
            else:
                self._step_bits += payload_bits * elements
                self._step_bytes += bytes_sent
                self._step_inter_calls += calls
        else:
            self.calls += calls
            if intra:
                self.intra_payload_bits += payload_bits * elements
                self.intra_bytes_sent += bytes_sent
            else:
                self.payload_bits += payload_bits * elements
                self.bytes_sent += bytes_sent
        entry = self.by_kind.setdefault(kind, {"calls": 0, "bytes_sent": 0, "elements": 0})
        entry["calls"] += calls
        entry["bytes_sent"] += bytes_sent
        entry["elements"] += elements

    def record_time(self, round_seconds: float = 0.0, exposed_seconds: float = 0.0) -> None:
        """Add the seconds bucketed rounds took, and the seconds step() waited for them (module docstring)."""
        with self._lock:
            self.round_seconds += round_seconds
            self.exposed_seconds += exposed_seconds

    def end_step(self) -> StepComm:
        """Close the current step and return what it sent."""
        if self.num_params <= 0:
            raise ValueError("CommLedger.num_params must be set before closing a step")
        step = StepComm(
            bits_per_param=self._step_bits / self.num_params,
            round=self._step_inter_calls > 0,
            bytes_sent=self._step_bytes,
            calls=self._step_calls,
            intra_bits_per_param=self._step_intra_bits / self.num_params,
            intra_bytes_sent=self._step_intra_bytes,
        )
        self.steps += 1
        self.rounds += int(step.round)
        self.bytes_sent += self._step_bytes
        self.calls += self._step_calls
        self.payload_bits += self._step_bits
        self.intra_bytes_sent += self._step_intra_bytes
        self.intra_payload_bits += self._step_intra_bits
        self._step_bits = self._step_bytes = self._step_calls = self._step_intra_bits = self._step_intra_bytes = self._step_inter_calls = 0
        return step

    @property
    def average_bits_per_param(self) -> float:
        """Cumulative average of nominal bits per parameter per step on the slow link."""
        return self._per_param_step(self.payload_bits)

    @property
    def average_intra_bits_per_param(self) -> float:
        """The same inside the node."""
        return self._per_param_step(self.intra_payload_bits)

    def _per_param_step(self, bits: int) -> float:
        if self.steps == 0 or self.num_params <= 0:
            return 0.0
        return bits / (self.num_params * self.steps)

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "bits_per_param": self.average_bits_per_param,
            "rounds": self.rounds,
            "bytes_sent": self.bytes_sent,
            "collective_calls": self.calls,
            "intra_bits_per_param": self.average_intra_bits_per_param,
            "intra_bytes_sent": self.intra_bytes_sent,
        }

    def state_dict(self) -> dict:
        return {
            "num_params": self.num_params,
            "steps": self.steps,
            "rounds": self.rounds,
            "bytes_sent": self.bytes_sent,
            "calls": self.calls,
            "payload_bits": self.payload_bits,
            "by_kind": {k: dict(v) for k, v in self.by_kind.items()},
            "intra_bytes_sent": self.intra_bytes_sent,
            "intra_payload_bits": self.intra_payload_bits,
        }

    def load_state_dict(self, state: dict) -> None:
        self.intra_bytes_sent = self.intra_payload_bits = 0  # a state saved before link classes sent nothing inside a node
        for key, value in state.items():
            setattr(self, key, dict(value) if key == "by_kind" else value)
        self._step_bits = self._step_bytes = self._step_calls = self._step_intra_bits = self._step_intra_bytes = self._step_inter_calls = 0
