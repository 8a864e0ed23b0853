"""Memory and MFU in the log records (zoa_train/train/monitor.py, Task.flops_per_unit): the device table by
name, the CPU peak that resets each window (and its announced lifetime fallback), MFU absent with one
warning or equal to the hand computation, and FLOPs per token against hand counts. The real 2-rank run
is tests/test_report.py's."""

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import transformers

from zoa_train.config import load_recipe
from zoa_train.runs import read_run
from zoa_train.tasks import task_of
from zoa_train.tasks.language import NotCounted, transformer_flops_per_token
from zoa_train.train import monitor
from zoa_train.train.metrics import MetricsLogger
from zoa_train.train.monitor import PEAK_TFLOPS, MemoryPeaks, RankMonitor, device_peak, matmul_format, peak_flops

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")

# torch.cuda.get_device_name() as it names each part (several spellings where drivers and form factors differ)
NAMED = {
    "NVIDIA H100 80GB HBM3": ("H100 SXM", 989.5, 494.5, 67.0),
    "NVIDIA H100 PCIe": ("H100 PCIe", 756.5, 378.0, 51.0),
    "NVIDIA H100 NVL": ("H100 NVL", 835.5, 417.5, 60.0),
    "NVIDIA H200": ("H200 SXM", 989.5, 494.5, 67.0),
    "NVIDIA H200 NVL": ("H200 NVL", 835.5, 417.5, 60.0),
    "NVIDIA GH200 480GB": ("GH200", 989.5, 494.5, 67.0),
    "NVIDIA B200": ("B200", 2250.0, 1125.0, 75.0),
    "NVIDIA A100-SXM4-40GB": ("A100", 312.0, 156.0, 19.5),
    "NVIDIA A100-SXM4-80GB": ("A100", 312.0, 156.0, 19.5),
    "NVIDIA A100-PCIE-40GB": ("A100", 312.0, 156.0, 19.5),
    "NVIDIA A100 80GB PCIe": ("A100", 312.0, 156.0, 19.5),
    "NVIDIA L40S": ("L40S", 362.05, 183.0, 91.6),
    "NVIDIA L40": ("L40", 181.05, 90.5, 90.5),
    "NVIDIA L4": ("L4", 121.0, 60.0, 30.3),
    "NVIDIA A10": ("A10", 125.0, 62.5, 31.2),
    "Tesla V100-SXM2-16GB": ("V100 SXM2", None, None, 15.7),
    "Tesla V100-SXM2-32GB": ("V100 SXM2", None, None, 15.7),
    "Tesla V100-PCIE-16GB": ("V100 PCIe", None, None, 14.0),
    "Tesla V100S-PCIE-32GB": ("V100S PCIe", None, None, 16.4),
    "NVIDIA GeForce RTX 4090": ("RTX 4090", 165.2, 82.6, 82.6),
    "NVIDIA GeForce RTX 3090": ("RTX 3090", 71.0, 35.6, 35.6),
}
# Parts whose names share a word with a listed one and whose compute differs, and parts not listed.
UNLISTED = ["NVIDIA A10G", "NVIDIA GeForce RTX 3090 Ti", "NVIDIA GeForce RTX 4090 D", "NVIDIA H800", "Tesla T4", "AMD Instinct MI300X", "cpu", ""]


@pytest.mark.parametrize("name", sorted(NAMED))
def test_the_device_table_finds_each_part_by_the_name_torch_gives(name):
    title, bf16, tf32, fp32 = NAMED[name]
    entry = device_peak(name)
    assert entry is not None and (entry.title, entry.bf16, entry.tf32, entry.fp32) == (title, bf16, tf32, fp32)


@pytest.mark.parametrize("name", UNLISTED)
def test_a_part_not_in_the_table_is_not_taken_for_a_neighbour(name):
    assert device_peak(name) is None


def test_the_table_is_dense_and_ordered():
    names = [n for entry in PEAK_TFLOPS for n in entry.names]
    assert len(names) == len(set(names))  # no name in two entries
    for entry in PEAK_TFLOPS:
        figures = [f for f in (entry.fp32, entry.tf32, entry.bf16) if f is not None]
        assert figures == sorted(figures) and entry.fp16 is not None, entry  # fp32 <= tf32 <= bf16; every part has fp16 tensor cores
        assert entry.bf16 is None or entry.bf16 == entry.fp16  # dense fp16 and bf16 run at one rate on every listed part


def test_fp32_peak_follows_torchs_matmul_precision(monkeypatch):
    assert matmul_format("bf16") == "bf16" and matmul_format("fp16") == "fp16"
    for setting, fmt in {"highest": "fp32", "high": "tf32", "medium": "bf16"}.items():
        monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda s=setting: s)
        assert matmul_format("fp32") == fmt


def test_peak_flops_by_device_precision_and_override(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_flops(cuda, "bf16", None) == (756.5e12, "")
    assert peak_flops(cuda, "fp32", None) == (51.0e12, "")
    assert peak_flops(cuda, "bf16", 400.0) == (400.0e12, "")  # train.peak_tflops wins over the table
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    assert peak_flops(cuda, "fp16", None) == (125.0e12, "")
    assert peak_flops(cuda, "bf16", None) == (None, "the V100 SXM2 has no bf16 tensor figure in zoa-train's table")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10G")
    assert peak_flops(cuda, "bf16", None) == (None, "NVIDIA A10G is not in zoa-train's table of peak FLOPS")
    assert peak_flops(CPU, "fp32", None) == (None, "zoa-train knows no peak FLOPS of a CPU")
    assert peak_flops(CPU, "fp32", 0.25) == (0.25e12, "")


# ---- memory ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")
def test_the_cpu_peak_resets_between_windows():
    peaks = MemoryPeaks(CPU)
    assert peaks.windowed  # this kernel lets the process reset VmHWM: the window's peak, not the lifetime's
    peaks.read_and_reset()
    big = torch.ones(400_000_000 // 4)  # 400 MB, every page touched, made and freed in window 1
    del big
    (first,) = peaks.read_and_reset()
    (second,) = peaks.read_and_reset()
    assert first - second > 300e6, (first, second)


def test_where_the_peak_cannot_be_reset_the_lifetime_peak_is_logged_under_its_own_name(tmp_path, monkeypatch, caplog):
    (tmp_path / "clear_refs").mkdir()  # writing to it fails, as a kernel that refuses
    peaks = MemoryPeaks(CPU, proc=tmp_path)
    assert not peaks.windowed
    (lifetime,) = peaks.read_and_reset()
    assert lifetime > 50e6  # this process with torch loaded
    monkeypatch.setattr(monitor, "MemoryPeaks", lambda device: MemoryPeaks(device, proc=tmp_path))
    with caplog.at_level(logging.WARNING):
        rank = RankMonitor(CPU, None, "fp32", None, world=1, is_main=True)
        records = [rank.record(100.0) for _ in range(3)]
    assert all(set(r) == {"mem_lifetime_peak_bytes", "mem_lifetime_peak_bytes_by_rank"} for r in records)
    assert records[-1]["mem_lifetime_peak_bytes_by_rank"] == [records[-1]["mem_lifetime_peak_bytes"]]
    assert [r.getMessage() for r in caplog.records if "lifetime peak" in r.getMessage()] == [
        "the kernel does not let this process reset its peak resident memory (/proc/self/clear_refs), so metrics.jsonl "
        "logs each rank's lifetime peak (mem_lifetime_peak_bytes) instead of each log window's"
    ]


# ---- MFU ------------------------------------------------------------------------------------------


def mfu_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("MFU is not logged")]


def test_no_mfu_and_one_warning_on_a_cpu_without_peak_tflops(caplog):
    with caplog.at_level(logging.WARNING):
        rank = RankMonitor(CPU, 5e6, "fp32", None, world=2, is_main=True)
        records = [rank.record(1000.0) for _ in range(3)]
        RankMonitor(CPU, 5e6, "fp32", None, world=2, is_main=False).record(1000.0)  # another rank says nothing
    assert not any("mfu_percent" in r for r in records)
    assert records[0]["mem_peak_bytes"] == max(records[0]["mem_peak_bytes_by_rank"]) > 0
    assert mfu_warnings(caplog) == [
        "MFU is not logged: zoa-train knows no peak FLOPS of a CPU; set train.peak_tflops to one device's peak dense TFLOPS "
        "at train.precision fp32 to log it (docs/metrics.md)"
    ]


def test_mfu_with_peak_tflops_is_tokens_per_second_per_rank_times_flops_over_the_peak(caplog):
    with caplog.at_level(logging.WARNING):
        record = RankMonitor(CPU, 5e6, "fp32", 0.5, world=2, is_main=True).record(1000.0)
    assert record["mfu_percent"] == pytest.approx(100 * (1000.0 / 2) * 5e6 / 0.5e12)  # 0.5%
    assert not mfu_warnings(caplog)


def test_a_task_without_flops_logs_memory_and_no_mfu_silently(caplog):
    # Image models: their FLOPs per image are not counted (docs/metrics.md), and no one expects an MFU there.
    with caplog.at_level(logging.WARNING):
        record = RankMonitor(CPU, None, "fp32", None, world=1, is_main=True).record(1000.0)
    assert "mfu_percent" not in record and "mem_peak_bytes" in record
    assert not caplog.records


def test_the_console_line_shows_memory_and_mfu(tmp_path, capsys):
    recipe = load_recipe(ROOT / "recipes" / "gpt2_tiny.yaml", ["logging.tensorboard=false", "logging.wandb=disabled"])
    logger = MetricsLogger(tmp_path, recipe, total_steps=20, start_step=0, enabled=True)
    base = {"step": 10, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 8000.0, "bits_per_param": 1.0, "rounds": 3}
    logger.log({**base, "mem_peak_bytes": 1_234_000_000, "mem_peak_bytes_by_rank": [1_234_000_000, 1_000_000_000], "mfu_percent": 41.23})
    logger.log({**base, "step": 20, "mem_lifetime_peak_bytes": 2_000_000_000, "mem_lifetime_peak_bytes_by_rank": [2_000_000_000]})
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert "3 rounds  mem 1.23 GB  MFU 41.2%  elapsed" in lines[0]
    assert "3 rounds  mem 2.00 GB (lifetime peak)  elapsed" in lines[1]
    # what the monitor writes, `report` reads; a per-rank key must be a list of numbers
    (tmp_path / "recipe.yaml").write_text("optimizer: {name: adam}\n")
    assert read_run(tmp_path).records[0]["mem_peak_bytes_by_rank"] == [1_234_000_000, 1_000_000_000]
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "mem_peak_bytes_by_rank": ["1 GB"]}) + "\n")
    with pytest.raises(Exception, match='has mem_peak_bytes_by_rank \\["1 GB"\\], which is not a list of numbers'):
        read_run(tmp_path)


# ---- FLOPs per token --------------------------------------------------------------------------------


def gpt2_flops_per_token(vocab: int, d: int, layers: int, seq_len: int) -> float:
    """By hand: per block ln_1 (2d), c_attn (d x 3d + 3d), attn c_proj (d x d + d), ln_2 (2d), c_fc (d x 4d + 4d),
    mlp c_proj (4d x d + d): 12 d^2 + 13 d; ln_f (2d); the output layer (vocab x d, tied to the token
    embedding, a matmul all the same); not the token and position tables. Attention: 12 L d T."""
    params = layers * (12 * d * d + 13 * d) + 2 * d + vocab * d
    return 6 * params + 12 * layers * d * seq_len


def model_of(recipe: str, *overrides: str) -> tuple[torch.nn.Module, object]:
    r = load_recipe(ROOT / "recipes" / recipe, list(overrides))
    return task_of(r.model.kind).model_for_counting(r), r


def test_flops_per_token_of_gpt2_tiny_by_hand():
    model, r = model_of("gpt2_tiny.yaml")
    assert (r.data.vocab_size, r.model.n_embd, r.model.n_layer, r.data.seq_len) == (4096, 128, 2, 64)
    assert transformer_flops_per_token(model, 64) == gpt2_flops_per_token(4096, 128, 2, 64) == 5_723_136
    assert transformer_flops_per_token(model, 256) == gpt2_flops_per_token(4096, 128, 2, 256)  # attention grows with T


def test_flops_per_token_of_llama_tiny_by_hand_tied_or_not():
    # d 128, 4 heads of 32, 2 key/value heads (k and v: d x 64), SwiGLU width 384, no biases, two RMSNorms
    # per block and a final one; tied or not, the output layer's matmul is counted once and the table not.
    d, f, kv, layers, vocab, seq = 128, 384, 64, 2, 4096, 64
    params = layers * (2 * d * d + 2 * d * kv + 3 * d * f + 2 * d) + d + vocab * d
    hand = 6 * params + 12 * layers * d * seq
    tied, _ = model_of("llama_tiny.yaml")
    untied, _ = model_of("llama_tiny.yaml", "model.tie_embeddings=false")
    assert sum(p.numel() for p in untied.parameters()) == sum(p.numel() for p in tied.parameters()) + vocab * d
    assert transformer_flops_per_token(tied, seq) == transformer_flops_per_token(untied, seq) == hand


def test_flops_per_token_of_bert_counts_its_tied_decoder_and_no_table():
    model, r = model_of("bert_tiny.yaml")
    d, layers, vocab, seq = r.model.n_embd, r.model.n_layer, model.config.vocab_size, r.data.seq_len
    tables = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    assert tables == (vocab + model.config.max_position_embeddings + model.config.type_vocab_size) * d
    params = sum(p.numel() for p in model.parameters()) - tables + vocab * d
    assert transformer_flops_per_token(model, seq) == 6 * params + 12 * layers * d * seq


def test_flops_per_token_of_sliding_windows_heads_apart_and_what_is_not_counted():
    # Mistral-style: every layer attends to at most its window (32 of 64 tokens); 4 heads of 48 (wider than d / heads)
    config = transformers.MistralConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=48, intermediate_size=96, sliding_window=32
    )
    model = transformers.MistralForCausalLM(config)
    params = sum(p.numel() for p in model.parameters()) - 256 * 64  # the token table out (untied: lm_head is a parameter of its own)
    assert transformer_flops_per_token(model, 64) == 6 * params + 12 * (4 * 48) * (32 + 32)
    moe = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
    )
    with pytest.raises(NotCounted, match="mixture of experts"):
        transformer_flops_per_token(moe, 64)
    with pytest.raises(NotCounted, match="no number of layers"):
        transformer_flops_per_token(torch.nn.Linear(4, 4), 64)
