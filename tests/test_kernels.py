"""The fused 1-bit kernels (zoa_train/comm/kernels: C++ on CPUs, Triton on GPUs, here through Triton's
interpreter) against the torch path, pass by pass, on the views of one process emulating n ranks.

What must hold: every sign bit and every output value bit-identical; each row's scale within one
rounding of the torch path's (the row's sum of squares is accumulated in another order: double
lanes in C++, a tree in Triton, torch's own in vector_norm); and each error exactly the torch
path's formula y + s - 2*s*[y >= 0] evaluated with the backend's own scale, so the only difference
is that reduction. Multi-rank runs against the reference and the error feedback's running mean are
in tests/test_comm.py, over every backend.
"""

import importlib

import pytest
import torch
import torch.multiprocessing as mp

from zoa_train.comm import ClusterCollective, CommLedger, pack_signs, unpack_signs
from zoa_train.comm.kernels import PartViews, backend, select_kernels
from zoa_train.comm.packing import pack_flags
from zoa_train.errors import UserError
from zoa_train.optim.zero_one_adam import finish_sync

# Triton's interpreter computes in numpy, which warns where a row holds an inf or NaN (on purpose).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
FUSED = ["native", "triton"]
ROWS = [(3, 5, 4096), (2, 7, 96), (4, 1, 32)]  # (n, rows per chunk, row): whole SCALE_ROWs, odd rows, one row


def part_views(n: int, rows: int, row: int, seed: int = 0) -> PartViews:
    """Views of one buffer of a call on n emulated ranks (this is rank n-1): wire segments with the
    signs and scales of every chunk, random values and received bits, rows of every magnitude, some
    padding (a short first row, a short last row), a zero row, a row with a NaN and one with an inf."""
    g = torch.Generator().manual_seed(seed)
    chunk = rows * row
    segment = chunk // 8 + 4 * rows

    def wire(k):
        w = torch.zeros(k, segment, dtype=torch.uint8)
        return w[:, : chunk // 8], w[:, chunk // 8 :].view(torch.float32)

    (send_signs, send_scales), (recv_signs, recv_scales), (gathered_signs, gathered_scales), (mine_signs, mine_scales) = (
        wire(n),
        wire(n),
        wire(n),
        wire(1),
    )
    valid = torch.full((n, rows), row, dtype=torch.int32)
    valid[0, 0], valid[-1, -1] = 5, row - 24
    worker = torch.randn(n, rows, row, generator=g) * torch.logspace(-4, 4, n * rows).view(n, rows, 1)
    worker[0, -1] = 0.0
    if n * rows > 3:
        worker[1, 0, 3], worker[-1, 0, 7] = float("nan"), float("inf")
    server = torch.randn(1, rows, row, generator=g)
    for signs, scales in ((recv_signs, recv_scales), (gathered_signs, gathered_scales)):
        signs.copy_(torch.randint(0, 256, signs.shape, generator=g, dtype=torch.uint8))
        scales.copy_(torch.rand(scales.shape, generator=g) * 3)
    return PartViews(
        worker=worker,
        valid=valid,
        norm=valid.clamp(min=1).float().sqrt(),
        send_signs=send_signs,
        send_scales=send_scales,
        recv_signs=recv_signs,
        recv_scales=recv_scales,
        server=server,
        rank=n - 1,
        mine_signs=mine_signs,
        mine_scales=mine_scales,
        gathered_signs=gathered_signs,
        gathered_scales=gathered_scales,
    )


def assert_compressed_like_torch(y, valid, error, signs, scales, torch_error, torch_signs, torch_scales):
    """A compression of rows y (k, r, row) equals the torch path's but for each row's scale, which
    is within one rounding of it (or as non-finite), and its error is the torch formula with that scale."""
    assert torch.equal(signs, torch_signs)
    finite = torch.isfinite(torch_scales)
    assert torch.equal(finite, torch.isfinite(scales))
    torch.testing.assert_close(scales[finite], torch_scales[finite], rtol=2.5e-7, atol=0)
    real = torch.arange(y.shape[2]) < valid[..., None]
    y = torch.where(real, y, 0.0)
    s = scales.unsqueeze(2)
    expected = (y + s).addcmul(torch.ge(y, 0).float(), s, value=-2)
    expected = torch.where(real, expected.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), 0.0)
    assert torch.equal(error, expected)
    same_scale = (scales == torch_scales).unsqueeze(2).expand_as(error)
    assert torch.equal(error[same_scale], torch_error[same_scale])


def run_passes(name: str, shape, addend_dtype=None, out_dtype=torch.float32):
    """Each pass of backend `name` on fresh views: what it read and what it wrote. With an addend the
    output starts one element into its allocation (not 32-byte aligned: no streamed stores)."""
    p = part_views(*shape)
    n, rows, row = shape
    y = p.worker.clone()
    addend = None
    if addend_dtype is not None:
        addend = torch.randn(n * rows * row, generator=torch.Generator().manual_seed(9)).to(addend_dtype)
        y = y + addend.float().view_as(y)
    kernels = backend(name)([p], torch.device("cpu"), None)
    kernels.worker(0, addend)
    # c as the torch path forms it, before its compression (the check of the server's arithmetic)
    coef = p.recv_scales * (2.0 / n)
    bits = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).float()  # row b: the 8 bits of byte b
    flags = bits[p.recv_signs.long()].view(n, rows, row)
    c = p.server[0].clone()
    for i in range(n):
        c.addcmul_(flags[i], coef[i].unsqueeze(1))
    c = (c - coef.sum(0).mul(0.5).unsqueeze(1)).unsqueeze(0)
    kernels.server(0)
    offset = int(addend_dtype is not None)
    out = torch.full((n * rows * row + 1,), 7.0, dtype=out_dtype)[offset : offset + n * rows * row]
    kernels.output(0, out)
    out = out.clone()
    written = PartViews(*(v.clone() if isinstance(v, torch.Tensor) else v for v in p))  # apart from the wire's storage, to save
    return {"y": y, "c": c, "p": written, "out": out}


def run_pack(name: str, numel: int) -> dict:
    """pack and unpack of backend `name` on `numel` values (every fifth a zero)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    x[::5] = 0.0
    module = importlib.import_module(backend(name).__module__)
    packed, out = torch.empty((numel + 7) // 8, dtype=torch.uint8), torch.empty(numel)
    module.pack(x, packed)
    module.unpack(packed, 0.25, out)
    return {"x": x, "packed": packed, "out": out}


PASS_CASES = [(shape, None, torch.float32) for shape in ROWS] + [
    ((2, 3, 64), addend, out) for addend in (torch.float32, torch.bfloat16) for out in (torch.float32, torch.bfloat16, torch.float16)
]
PACK_CASES = [1, 8, 13, 4096 * 3 + 5]


def outputs(name: str) -> dict:
    """What backend `name` computes in every case."""
    return {"passes": [run_passes(name, *case) for case in PASS_CASES], "pack": [run_pack(name, numel) for numel in PACK_CASES] if name != "torch" else []}


def _outputs_in_child(name: str, path: str) -> None:
    torch.save(outputs(name), path)


@pytest.fixture(scope="module")
def computed(tmp_path_factory):
    """outputs(name), once per backend. Triton's run in a fresh process under TRITON_INTERPRET=1:
    the interpreter must be on before Triton defines the kernels, and this process may have
    imported them already (sizing a CUDA collective does)."""
    cache = {}

    def get(name: str) -> dict:
        if name not in cache:
            if name == "triton":
                path = str(tmp_path_factory.mktemp("triton") / "outputs.pt")
                with pytest.MonkeyPatch.context() as patch:
                    patch.setenv("TRITON_INTERPRET", "1")
                    child = mp.get_context("spawn").Process(target=_outputs_in_child, args=(name, path))
                    child.start()
                    child.join(300)
                assert child.exitcode == 0, "the Triton kernels failed under the interpreter"
                cache[name] = torch.load(path, weights_only=False)
            else:
                reason = backend(name).unavailable(torch.device("cpu"))
                assert reason is None, f"the {name} kernels must run in the test suite: {reason}"
                cache[name] = outputs(name)
        return cache[name]

    return get


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("case", range(len(PASS_CASES)), ids=[f"{shape}-{addend}-{out}".replace("torch.", "") for shape, addend, out in PASS_CASES])
def test_every_pass_equals_the_torch_path_but_for_the_rounding_of_each_row_scale(computed, fused, case):
    mine, ref = computed(fused)["passes"][case], computed("torch")["passes"][case]
    p, q = mine["p"], ref["p"]
    assert_compressed_like_torch(mine["y"], p.valid, p.worker, p.send_signs, p.send_scales, q.worker, q.send_signs, q.send_scales)
    rank = p.rank
    assert_compressed_like_torch(mine["c"], p.valid[rank : rank + 1], p.server, p.mine_signs, p.mine_scales, q.server, q.mine_signs, q.mine_scales)
    # +-scale and zero padding, exact; in bf16 and fp16 rounded to nearest as torch's .to() rounds
    assert mine["out"].dtype == PASS_CASES[case][2] and torch.equal(mine["out"], ref["out"])


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("case", range(len(PACK_CASES)), ids=[str(numel) for numel in PACK_CASES])
def test_pack_and_unpack_equal_the_torch_path(computed, fused, case):
    got = computed(fused)["pack"][case]
    x = got["x"]
    assert torch.equal(got["packed"], pack_signs_torch(x))
    assert torch.equal(got["out"], torch.where(x >= 0, 0.25, -0.25))


def pack_signs_torch(x: torch.Tensor) -> torch.Tensor:
    """The torch path's packing of x's signs (the last byte's missing elements as +1)."""
    flags = torch.ge(torch.cat([x, torch.zeros(-x.numel() % 8)]), 0).float()
    packed = torch.empty(flags.numel() // 8, dtype=torch.uint8)
    return pack_flags(flags, torch.empty(flags.numel(), dtype=torch.int8), packed)


@pytest.mark.parametrize("decay,lr_sum", [(1.0, 0.0), (0.9993, 0.0123)])
def test_native_end_of_a_sync_equals_zero_one_adams_torch_ops(decay, lr_sum):
    # 0/1 Adam's flat layout: five tensors out of order, padding between them (m and anchor 0 there,
    # the denominator inf as for a zero variance), w_bar of every magnitude with a NaN and an inf,
    # denominators that overflow w_bar*d and infinite ones inside tensors.
    g = torch.Generator().manual_seed(1)
    sizes, offsets, size = [7, 300, 4096, 1, 33], [4500, 4100, 0, 4432, 4440], 4520
    m = torch.zeros(size)
    anchor = torch.zeros(size)
    denom = torch.full((size,), float("inf"))
    for o, k in zip(offsets, sizes):
        m[o : o + k] = torch.randn(k, generator=g) * torch.logspace(-8, 8, k)
        anchor[o : o + k] = torch.randn(k, generator=g)
        denom[o : o + k] = torch.rand(k, generator=g) * 1e-2 + 1e-8
    m[4103], m[17] = float("nan"), float("-inf")
    denom[5], denom[4200] = float("inf"), 3e38
    params = [torch.zeros(k) for k in sizes]
    expected = [t.clone() for t in (m, anchor)], [p.clone() for p in params]
    finish_sync(*expected[0], denom, decay, lr_sum, expected[1], [expected[0][1][o : o + k] for o, k in zip(offsets, sizes)])
    order = sorted(range(5), key=offsets.__getitem__)
    native = importlib.import_module("zoa_train.comm.kernels.native")
    native.finish_sync(m, anchor, denom, decay, lr_sum, [params[i] for i in order], [offsets[i] for i in order])
    assert torch.equal(m, expected[0][0]) and torch.equal(anchor, expected[0][1])
    assert all(torch.equal(p, q) for p, q in zip(params, expected[1]))
    assert m.isfinite().all() and m[5] == 0 and (m[4096:4100] == 0).all() and (m[4400:4432] == 0).all()
    with pytest.raises(RuntimeError, match="ascending"):
        native.finish_sync(m, anchor, denom, decay, lr_sum, params, offsets)


def test_auto_takes_the_native_kernels_on_this_cpu_and_the_public_codec_uses_them():
    assert select_kernels("auto", "cpu") is backend("native")
    x = torch.randn(1001)
    assert torch.equal(unpack_signs(pack_signs(x), x.numel(), 2.0), torch.where(x >= 0, 2.0, -2.0))


def test_a_recipe_naming_kernels_that_cannot_run_is_refused_in_one_sentence(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError, match=r"^comm.kernels: the triton 1-bit kernels cannot run on cpu here: .*\.$"):
        ClusterCollective("flat", kernels="triton")([[10, 20]], group=None, device=torch.device("cpu"), ledger=CommLedger(num_params=30))


def test_a_backend_that_cannot_run_is_refused_by_name_and_skipped_by_auto(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="the triton 1-bit kernels cannot run on cpu here"):
        select_kernels("triton", "cpu")
    with pytest.raises(ValueError, match="unknown 1-bit kernels 'cuda'"):
        select_kernels("cuda", "cpu")
    native = importlib.import_module("zoa_train.comm.kernels.native")
    monkeypatch.setitem(native._built, "error", "CalledProcessError: g++ not found")
    monkeypatch.delitem(native._built, "module", raising=False)
    assert select_kernels("auto", "cpu") is backend("torch")


# ---- a native build that fails says why, where, and once (issue 49) ---------------------------------


def test_the_first_line_naming_an_error_is_what_a_failed_build_says():
    from zoa_train.comm.kernels.native import first_error

    log = (
        "Error building extension 'zoa_onebit_x': [1/2] c++ -MMD -MF native.o.d -O3 -c native.cpp -o native.o\n"
        "FAILED: native.o\nc++ -MMD -MF native.o.d -O3 -c native.cpp -o native.o\n"
        "In file included from /usr/include/error.h:3,\n"
        "native.cpp:1:10: fatal error: torch/extension.h: No such file or directory\n"
        "compilation terminated.\nninja: build stopped: subcommand failed.\n"
    )
    assert first_error(log) == "native.cpp:1:10: fatal error: torch/extension.h: No such file or directory"
    assert (
        first_error("Ninja is required to load C++ extensions (pip install ninja to get it)")
        == "Ninja is required to load C++ extensions (pip install ninja to get it)"
    )
    assert first_error("FAILED: native.o\nninja: build stopped: subcommand failed.\n") == "ninja: build stopped: subcommand failed."


def _kernels_without_a_compiler(rank, world_size):
    """The backend a 1-bit allreduce gets here (CXX names no compiler) and what the kernels' log said, by level."""
    import logging

    from zoa_train.comm import OneBitAllReduce

    said = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: said.append((record.levelname, record.getMessage()))
    logger = logging.getLogger("zoa_train.comm.kernels")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    comm = OneBitAllReduce(5000, kernels="auto")
    comm.op(torch.ones(5000))
    return type(comm.kernels).__module__, said


@pytest.mark.slow  # 2 ranks, about 10 s
def test_without_a_compiler_the_torch_path_runs_and_the_first_rank_names_the_compiler_and_the_host(monkeypatch, tmp_path):
    import socket

    from distributed_harness import run_ranks

    monkeypatch.setenv("CXX", "/nonexistent/g++")  # cpp_extension's compiler; the ranks inherit it
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # the build cache the other tests use is left alone
    monkeypatch.delenv("LOCAL_RANK", raising=False)  # each rank then finds its place from its group, as without a launcher
    ranks = run_ranks(_kernels_without_a_compiler, 2)
    expected = (
        "the 1-bit allreduce runs the unfused torch path on cpu instead of the native kernels: they could not be built on host "
        f"{socket.gethostname()}: the C++ compiler /nonexistent/g++ was not found (install g++, or set CXX to a C++ compiler)"
    )
    assert [r[0] for r in ranks] == ["zoa_train.comm.kernels.torch_ops"] * 2
    assert ranks[0][1] == [("WARNING", expected)]  # said once, by the first rank,
    assert ranks[1][1] == [("DEBUG", expected)]  # the others only at debug level


@pytest.mark.slow  # a Python process with torch, about 3 s
def test_a_compiler_that_fails_is_named_by_the_first_error_line_of_its_build(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    compiler = tmp_path / "bad-g++"
    compiler.write_text("#!/bin/sh\necho \"bad-g++: error: unrecognized command-line option '-march=native'\" >&2\nexit 1\n")
    compiler.chmod(0o755)
    env = {**os.environ, "CXX": str(compiler), "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    done = subprocess.run([sys.executable, "-m", "zoa_train.comm.kernels.native"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        f"the native 1-bit kernels are not used: they could not be built on host {socket.gethostname()}: "
        "bad-g++: error: unrecognized command-line option '-march=native'; the torch path runs instead"
    )
