"""PowerSGD (Vogels et al. 2019) as torch ships it: DDP's PowerSGD communication hook, Adam on top.

torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook does the compression: each gradient that
is worth compressing, viewed as a matrix M of shape[0] rows, becomes P = M Q and Q = M^T P of rank r,
both allreduced in fp32 (Q warm-started from the previous step, the compression error fed back into
the next step's gradient); vectors and matrices too small to gain are allreduced whole; the first
`start_step` steps are plain allreduces (in `warmup_dtype`, as `adam`'s). PowerSGDHook wraps torch's
hook to do what that hook leaves to its caller:

- the ledger: what each bucket sends, counted from its tensors' shapes by the hook's own rule
  (`powersgd_elements`, which `plan` uses too);
- exact resume: torch keeps its error feedback and warm-start Q per DDP bucket index, and every new
  DDP lays its buckets out anew (one bucket for its first step, buckets in gradient order from the
  second), so the first step of a resumed run meets other buckets than the step it continues. The
  wrapper carries the state over by parameter whenever the layout of a bucket changes, and saves it
  by parameter. Across two layouts the matrix products of that first step round differently (by
  about 1e-7); on Gloo, where buckets run one at a time anyway, the layout is fixed at construction,
  which makes the resumed trajectory the same to the bit;
- Q's random start is drawn per parameter from (seed, step, parameter) instead of once per bucket
  from the hook's generator, for the same reason.
"""

import math

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from zoa_train.comm import CommLedger, ring_allreduce_bytes
from zoa_train.step_kinds import FULL, LOW_RANK

# torch's default of 0 divides by zero when a column of P is exactly zero (a gradient matrix that is
# zero, or of lower rank than r): a small epsilon leaves such a column zero instead of NaN.
ORTHOGONALIZATION_EPSILON = 1e-8


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix PowerSGD sees for a tensor of `shape`: shape[0] rows, the rest as columns."""
    rows = shape[0] if shape else 1
    return rows, math.prod(shape) // rows if rows else 0


def compressed_rank(shape: tuple[int, ...], rank: int, min_compression_rate: float) -> int:
    """The rank PowerSGD sends a tensor of `shape` at, or 0 where it sends the tensor whole: torch's
    rule, compress when (n + m) r * min_compression_rate < n m, with r = min(n, m, rank)."""
    n, m = matrix_shape(shape)
    r = min(n, m, rank)
    return r if (n + m) * r * min_compression_rate < n * m else 0


def powersgd_elements(shapes, rank: int, min_compression_rate: float) -> tuple[int, int, int]:
    """Elements one compressed step sends for tensors of `shapes`: (sent whole, in the Ps, in the Qs)."""
    whole = ps = qs = 0
    for shape in shapes:
        n, m = matrix_shape(tuple(shape))
        r = compressed_rank(tuple(shape), rank, min_compression_rate)
        if r:
            ps, qs = ps + n * r, qs + m * r
        else:
            whole += n * m
    return whole, ps, qs


class PowerSGDHook:
    """torch's PowerSGD DDP hook with a ledger, state kept by parameter, and per-parameter Q starts.

    Register it through `register(ddp_module, ledger)` (DDPBacked does). Parameters: rank=1 (torch's
    matrix_approximation_rank), start_step=1000 (torch's start_powerSGD_iter: plain allreduces before;
    at least 2 with error feedback or warm start, as torch requires), min_compression_rate=2.0,
    error_feedback=True, warm_start=True (torch's defaults), seed=0 (of Q's random starts),
    warmup_dtype (None: fp32; fp16 or bf16 as DDP's compress hooks send them), process_group (default:
    the world).
    State: this rank's error feedback (one fp32 copy of the gradients) and the warm-start Qs.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        rank: int = 1,
        start_step: int = 1000,
        min_compression_rate: float = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
        warmup_dtype: torch.dtype | None = None,
        process_group=None,
    ):
        if rank < 1:
            raise ValueError(f"PowerSGD's rank must be at least 1, got {rank}")
        # The hook always warm-starts; without warm start this wrapper draws fresh Qs every step.
        self.state = torch_powersgd.PowerSGDState(
            process_group,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=start_step,
            min_compression_rate=min_compression_rate,
            use_error_feedback=error_feedback,
            warm_start=True,
            orthogonalization_epsilon=ORTHOGONALIZATION_EPSILON,
            compression_stats_logging_frequency=2**62,
        )
        self.warm_start, self.seed = warm_start, seed
        self.params = list(model.parameters())
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._layouts: dict[int, tuple[int, ...]] = {}  # bucket index -> its parameters, as its state is laid out
        self._error_pool: dict[int, torch.Tensor] = {}  # parameter -> its error feedback, while buckets change layout
        self._q_pool: dict[int, torch.Tensor] = {}  # parameter -> its warm-start Q
        self._compressed_cache: dict[tuple[int, ...], list[tuple[int, int, int, int]]] = {}
        self.world_size = dist.get_world_size(process_group)
        # The hook's later allreduces (the Ps, the Qs) are issued by callbacks on whichever thread ends the
        # one before; Gloo runs collectives in the order they are issued, so with several buckets in
        # flight two ranks can issue them in different orders and mismatch. On Gloo each bucket is
        # therefore finished before backward goes on; NCCL (the GPU case) keeps them overlapped.
        self._one_bucket_at_a_time = dist.get_backend(process_group) == "gloo"
        compress = {torch.float16: default_hooks.fp16_compress_hook, torch.bfloat16: default_hooks.bf16_compress_hook}
        self._warmup_hook = compress.get(warmup_dtype, default_hooks.allreduce_hook)
        self._warmup_bits = 16 if warmup_dtype in compress else 32
        self.ledger: CommLedger | None = None
        self._compressed_step = False

    def register(self, module: torch.nn.Module, ledger: CommLedger) -> None:
        self.ledger = ledger
        module.register_comm_hook(self.state, self._hook)
        if self._one_bucket_at_a_time:
            # On Gloo nothing overlaps anyway: lay the buckets out once, in parameter order, so that every
            # process (a resumed one too) computes in the same buckets from its first step. Carried-over
            # state is then exact to the bit; across two layouts the matrix products round differently.
            # (DistributedDataParallel's own entry points for this, as its Join hook uses them.)
            module.reducer._push_all_rebuilt_params()
            module.reducer._rebuild_buckets()

    def step_kind(self) -> str:
        return LOW_RANK if self._compressed_step else FULL

    # ---- the hook ---------------------------------------------------------------------------------

    def _hook(self, state, bucket):
        index = bucket.index()
        self._compressed_step = state.iter >= state.start_powerSGD_iter
        if not self._compressed_step:
            numel = bucket.buffer().numel()
            bits = self._warmup_bits
            self.ledger.record("ddp_allreduce", payload_bits=bits, elements=numel, bytes_sent=ring_allreduce_bytes(numel, bits // 8, self.world_size))
            state.maybe_increase_iter(bucket)
            return self._warmup_hook(state.process_group, bucket)
        key = tuple(self._index[id(p)] for p in bucket.parameters())
        if self._layouts.get(index) != key:
            self._relayout(index, key)
        if index not in state.q_memory_dict or not self.warm_start:
            self._fresh_qs(index, key, bucket.buffer().device)
        whole, ps, qs = powersgd_elements([self.params[i].shape for i in key], state.matrix_approximation_rank, state.min_compression_rate)
        for kind, elements in (("powersgd_whole", whole), ("powersgd_p", ps), ("powersgd_q", qs)):
            self.ledger.record(kind, payload_bits=32, elements=elements, bytes_sent=ring_allreduce_bytes(elements, 4, self.world_size))
        future = torch_powersgd.powerSGD_hook(state, bucket)
        if self._one_bucket_at_a_time:
            future.wait()
        return future

    def _compressed(self, key: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
        """(parameter, rows, columns, rank) of the tensors the hook compresses in a bucket of `key`, in the
        order it lays their Ps and Qs out: grouped by matrix shape, shapes in order of first appearance."""
        if key not in self._compressed_cache:
            groups: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
            for i in key:
                shape = tuple(self.params[i].shape)
                r = compressed_rank(shape, self.state.matrix_approximation_rank, self.state.min_compression_rate)
                if r:
                    n, m = matrix_shape(shape)
                    groups.setdefault((n, m), []).append((i, n, m, r))
            self._compressed_cache[key] = [entry for group in groups.values() for entry in group]
        return self._compressed_cache[key]

    def _relayout(self, index: int, key: tuple[int, ...]) -> None:
        """Give bucket `index`, now holding the parameters `key`, their state. Buckets run in index order
        within a step, so at the first bucket of a step whose layout changed, every bucket from it on
        still holds the previous step's state: it goes to the pools by parameter, and each bucket takes
        its parameters' share back as it comes."""
        state = self.state
        if not self._error_pool and not self._q_pool:
            for old in [i for i in self._layouts if i >= index]:
                errors, qs = self._split(old)
                self._error_pool |= errors
                self._q_pool |= qs
                self._layouts.pop(old)
                for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
                    memory.pop(old, None)
        errors = [self._error_pool.pop(i) for i in key if i in self._error_pool]
        if errors:
            if len(errors) != len(key):
                raise RuntimeError(f"PowerSGD error feedback found for {len(errors)} of the {len(key)} parameters of bucket {index}")
            state.error_dict[index] = torch.cat(errors)
        compressed = self._compressed(key)
        qs = [self._q_pool.pop(i) for i, *_ in compressed if i in self._q_pool]
        if qs:
            if len(qs) != len(compressed):
                raise RuntimeError(f"PowerSGD warm-start Q found for {len(qs)} of the {len(compressed)} matrices of bucket {index}")
            state.q_memory_dict[index] = torch.cat(qs)
            state.p_memory_dict[index] = torch.empty(sum(n * r for _, n, _, r in compressed), dtype=qs[0].dtype, device=qs[0].device)
        self._layouts[index] = key

    def _split(self, index: int) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Bucket `index`'s error feedback and Qs, by parameter (views into the bucket's tensors)."""
        key, state = self._layouts[index], self.state
        errors, qs = {}, {}
        if index in state.error_dict:
            sizes = [self.params[i].numel() for i in key]
            errors = dict(zip(key, state.error_dict[index].split(sizes)))
        if index in state.q_memory_dict:
            compressed = self._compressed(key)
            qs = dict(zip((i for i, *_ in compressed), state.q_memory_dict[index].split([m * r for _, _, m, r in compressed])))
        return errors, qs

    def _fresh_qs(self, index: int, key: tuple[int, ...], device: torch.device) -> None:
        """Random Qs for bucket `index`, the same on every rank: each matrix's from (seed, step, parameter)."""
        compressed = self._compressed(key)
        qs = []
        for i, _, m, r in compressed:
            generator = torch.Generator().manual_seed(int(np.random.SeedSequence([self.seed, self.state.iter, i]).generate_state(1)[0]))
            qs.append(torch.randn(m * r, generator=generator))
        self.state.q_memory_dict[index] = (torch.cat(qs) if qs else torch.empty(0)).to(device)
        self.state.p_memory_dict[index] = torch.empty(sum(n * r for _, n, _, r in compressed), device=device)

    # ---- state ------------------------------------------------------------------------------------

    def shared_state_dict(self) -> dict:
        s = self.state
        return {"iter": s.iter, "rank": s.matrix_approximation_rank, "min_compression_rate": s.min_compression_rate, "error_feedback": s.use_error_feedback}

    def rank_state_dict(self) -> dict:
        """This rank's error feedback and Qs by parameter (copies: the live state keeps changing)."""
        errors, qs = dict(self._error_pool), dict(self._q_pool)
        for index in self._layouts:
            more_errors, more_qs = self._split(index)
            errors |= more_errors
            qs |= more_qs if self.warm_start else {}
        return {"errors": {i: t.clone() for i, t in errors.items()}, "qs": {i: t.clone() for i, t in qs.items()}}

    def load_state_dicts(self, shared: dict, rank: dict) -> None:
        self._load_shared(shared)
        device = self.params[0].device if self.params else torch.device("cpu")
        self._error_pool = {i: t.to(device) for i, t in rank["errors"].items()}
        self._q_pool = {i: t.to(device) for i, t in rank["qs"].items()}

    def load_resharded(self, shared: dict) -> None:
        self._load_shared(shared)  # error feedback and Qs start afresh, as at the first compressed step

    def _load_shared(self, shared: dict) -> None:
        s = self.state
        mine = {"rank": s.matrix_approximation_rank, "min_compression_rate": s.min_compression_rate, "error_feedback": s.use_error_feedback}
        changed = [f"{k} {shared[k]} there and {v} here" for k, v in mine.items() if shared[k] != v]
        if changed:
            raise ValueError(f"the PowerSGD state was saved with other settings ({', '.join(changed)}); resume with the recipe's settings")
        s.iter = shared["iter"]
        for memory in (s.error_dict, s.p_memory_dict, s.q_memory_dict):
            memory.clear()
        self._layouts.clear()
        self._error_pool, self._q_pool = {}, {}
