"""CommLedger: what every collective issued through zoa_train.comm cost, per step and in total.

Conventions (docs/algorithm.md, "Counting"): nominal bits per parameter per step are the
payload bits of each element sent (32 fp32, 16 fp16/bf16, 1 for a 1-bit round, 0 for a local step),
summed over the step's collectives and divided by the number of parameters; a round is a step with
any data-parallel communication; bytes are what this rank sends, scales, padding and both passes
included, under the standard algorithm of each collective (ring for allreduce and all-gather).
"""

from dataclasses import dataclass, field


@dataclass
class StepComm:
    """Communication of one optimizer step on this rank."""

    bits_per_param: float
    round: bool
    bytes_sent: int
    calls: int


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
    _step_bits: int = 0
    _step_bytes: int = 0
    _step_calls: int = 0

    def record(self, kind: str, payload_bits: int, elements: int, bytes_sent: int, calls: int = 1, in_step: bool = True) -> None:
        """Record one logical collective (`calls` underlying collective calls) in the current step,
        or with `in_step=False` (a sync outside the optimizer's steps, e.g. before a checkpoint)
        straight into the totals: it adds bits and bytes but makes no step a round."""
        if in_step:
            self._step_bits += payload_bits * elements
            self._step_bytes += bytes_sent
            self._step_calls += calls
        else:
            self.payload_bits += payload_bits * elements
            self.bytes_sent += bytes_sent
            self.calls += calls
        entry = self.by_kind.setdefault(kind, {"calls": 0, "bytes_sent": 0, "elements": 0})
        entry["calls"] += calls
        entry["bytes_sent"] += bytes_sent
        entry["elements"] += elements

    def end_step(self) -> StepComm:
        """Close the current step and return what it sent."""
        if self.num_params <= 0:
            raise ValueError("CommLedger.num_params must be set before closing a step")
        step = StepComm(
            bits_per_param=self._step_bits / self.num_params,
            round=self._step_calls > 0,
            bytes_sent=self._step_bytes,
            calls=self._step_calls,
        )
        self.steps += 1
        self.rounds += int(step.round)
        self.bytes_sent += self._step_bytes
        self.calls += self._step_calls
        self.payload_bits += self._step_bits
        self._step_bits = self._step_bytes = self._step_calls = 0
        return step

    @property
    def average_bits_per_param(self) -> float:
        """Cumulative average of nominal bits per parameter per step."""
        if self.steps == 0 or self.num_params <= 0:
            return 0.0
        return self.payload_bits / (self.num_params * self.steps)

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "bits_per_param": self.average_bits_per_param,
            "rounds": self.rounds,
            "bytes_sent": self.bytes_sent,
            "collective_calls": self.calls,
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
        }

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, dict(value) if key == "by_kind" else value)
        self._step_bits = self._step_bytes = self._step_calls = 0
