"""The bad-input catalogue (docs/bad-input.md): each case through the real CLI exits 2 with one sentence
naming the key, file or value, no traceback, leaves the user's files alone, and says what the catalogue
documents for it (tests/catalogue.py).

Tables: CASES (`zoa-train run`), COMMAND_CASES (the other commands), RESUME_REFUSALS (a resume refused,
each against a copy of a run directory that must stay byte for byte the same); BAD_RECIPES are in
tests/test_run.py, bad image data in tests/test_tasks.py. The library's own refusals come last."""

import json
import re
import sys
from pathlib import Path

import pytest
from catalogue import check_documented
from conftest import refused, zoa, zoa_here

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "gpt2_tiny.yaml")


def sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def quick(cache_dir: Path, *extra: str) -> list[str]:
    """A 2-step gpt2_tiny run that writes little: for the cases that get as far as starting ranks."""
    return sets(
        "train.steps=2",
        "train.log_every=1",
        "train.val_batches=1",
        "train.val_every=0",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        f"data.cache_dir={cache_dir}",
        *extra,
    )


def recipe_file(text: str):
    return lambda tmp, cache, run: (tmp.joinpath("recipe.yaml").write_text(text), [str(tmp / "recipe.yaml")])[1]


def recipe_with(*pairs: str):
    return lambda tmp, cache, run: [RECIPE, *sets(*pairs)]


def directory_as_data_file(tmp, cache, run):
    (tmp / "corpus.txt").mkdir()
    return [RECIPE, *sets("data.source=files", f"data.train_files={tmp / 'corpus.txt'}")]


def garbage_data_file(tmp, cache, run):
    (tmp / "corpus.txt").write_bytes(b"\xff\xfe\x00 not text \xc3\x28\n" * 64)
    return [RECIPE, *quick(cache, "data.source=files", f"data.train_files={tmp / 'corpus.txt'}")]


def streamed_files(field: str = "text", *unset: str):
    """gpt2_tiny streaming JSON lines whose documents are under `field`, without the data keys in `unset`."""

    def args(tmp, cache, run):
        for name in ("train.jsonl", "val.jsonl"):
            (tmp / name).write_text(json.dumps({"id": 1, field: "a document"}) + "\n")
        data = {
            "data.source": "files",
            "data.train_files": f"[{tmp / 'train.jsonl'}]",
            "data.validation_files": f"[{tmp / 'val.jsonl'}]",
            "data.streaming": "true",
            "data.tokenizer": str(tmp),  # a directory: refused before it is ever loaded
        }
        return [RECIPE, *sets(*(f"{key}={value}" for key, value in data.items() if key not in unset))]

    return args


def recipe_bytes(data: bytes):
    return lambda tmp, cache, run: (tmp.joinpath("recipe.yaml").write_bytes(data), [str(tmp / "recipe.yaml")])[1]


def bracketed_recipe(tmp, cache, run):
    """A recipe whose file name holds what rich would read as markup: the message names it as it is."""
    path = tmp / "gpt2[old][bold].yaml"
    path.write_text(Path(RECIPE).read_text().replace("n_head: 4", "n_head: 3"))
    return [str(path)]


def resume_from(where: str):
    def args(tmp, cache, run):
        target = {"not a checkpoint": tmp, "missing": tmp / "nothere"}[where]
        return [RECIPE, "--resume", str(target)]

    return args


def a_file_in_the_way(tmp: Path) -> Path:
    """A file where a directory would have to be created: tmp/file/..."""
    (tmp / "file").write_text("not a directory")
    return tmp / "file"


def non_empty_run_directory(tmp, cache, run):
    run.mkdir()
    (run / "notes.txt").write_text("kept")
    return [RECIPE]


def checkpoint_of_four_ranks(tmp, cache, run):
    checkpoint = run / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "COMPLETE").write_text("step 4\nworld_size 4\n")
    return [RECIPE, "--resume", "auto"]


def init_from(make: str):
    """gpt2_tiny from a pretrained model that tests/test_pretrained.py's `make` writes (a real tiny transformers model)."""

    def args(tmp, cache, run):
        import test_pretrained  # torch and transformers: only for the cases that need them

        return [RECIPE, *sets(f"model.init_from={getattr(test_pretrained, make)(tmp / 'pretrained')}")]

    return args


def gpt2_tiny_run(tmp, recipe_n_layer: int = 2):
    import test_export  # torch and transformers: only for the cases that need them

    return test_export.gpt2_tiny_run(tmp, recipe_n_layer)


def megatron_prefix(spoil=None, *pairs: str, tokenizer: bool = True):
    """gpt2_tiny from tmp/corpus, a Megatron prefix of 40 documents of 4 uint16 tokens (zoa-train's writer),
    spoiled first by `spoil` (of the prefix's path)."""

    def args(tmp, cache, run):
        import numpy as np

        from zoa_train.data.indexed import write_indexed

        write_indexed(tmp / "corpus", np.arange(160, dtype=np.uint16) % 50, [4] * 40)
        if spoil is not None:
            spoil(tmp / "corpus")
        tokenizer_set = ["data.tokenizer=gpt2"] if tokenizer else []  # a hub name: only checked to be one before the ranks start
        return [RECIPE, *sets("data.source=megatron", f"data.prefixes=[{tmp / 'corpus'}]", *tokenizer_set, *pairs)]

    return args


def rewritten(suffix: str, edit):
    """A spoiler: the prefix's .idx or .bin replaced by `edit` of its bytes."""

    def spoil(prefix: Path) -> None:
        path = prefix.with_name(prefix.name + suffix)
        path.write_bytes(bytes(edit(bytearray(path.read_bytes()))))

    return spoil


def another_version(data: bytearray) -> bytearray:
    data[9:17] = (2).to_bytes(8, "little")
    return data


def empty_prefix(prefix: Path) -> None:
    import numpy as np

    from zoa_train.data.indexed import write_indexed

    write_indexed(prefix, np.zeros(0, dtype=np.uint16), [])


# name: (arguments(tmp_path, cache_dir, run_dir) -> zoa run arguments, expected text in the sentence,
#        whether ranks start first: they prepare the run directory (new and empty here) before reading data)
CASES = {
    "malformed yaml": (recipe_file("model:\n  kind: gpt2\n  size: [\n"), "is not valid YAML at line", False),
    "empty file": (recipe_file(""), "is empty; a recipe must at least name model.kind", False),
    "only comments": (recipe_file("# nothing yet\n"), "is empty; a recipe must at least name model.kind", False),
    "empty mapping": (recipe_file("{}\n"), "is empty; a recipe must at least name model.kind", False),
    "no model.kind": (recipe_file("train:\n  steps: 10\n"), "does not name model.kind", False),
    "not a mapping": (recipe_file("- gpt2\n- adam\n"), "must hold a mapping of sections", False),
    "unknown model": (
        recipe_file("model:\n  kind: gpt3\n"),
        "model.kind must be one of gpt2, bert, resnet18, resnet34, resnet50, llama, hf_causal_lm, not 'gpt3'",
        False,
    ),
    "unknown model size": (recipe_with("model.size=huge"), "model.size 'huge' is not a gpt2 preset", False),
    "unknown schedule": (recipe_with("schedule.name=linear"), "schedule.name must be one of constant, exponential, cosine, not 'linear'", False),
    "data of another task": (recipe_with("model.kind=resnet18"), "data.source must be digits or folder for resnet18, not 'bundled'", False),
    "zero layers": (recipe_with("model.n_layer=0"), "model.n_layer must be positive, not 0", False),
    "negative width": (recipe_with("model.n_embd=-8"), "model.n_embd must be positive, not -8", False),
    "heads do not divide width": (recipe_with("model.n_head=3"), "model.n_embd 128 must be divisible by model.n_head 3", False),
    "zero micro batch": (recipe_with("train.micro_batch_size=0"), "train.micro_batch_size must be positive, not 0", False),
    "negative seq_len": (recipe_with("data.seq_len=-4"), "data.seq_len must be positive, not -4", False),
    "negative warmup": (recipe_with("schedule.warmup_steps=-1"), "schedule.warmup_steps must be >= 0, not -1", False),
    "data file is a directory": (directory_as_data_file, "corpus.txt is a directory", False),
    "data file is not text": (garbage_data_file, "corpus.txt: 'utf-8' codec can't decode", True),
    "streaming the bundled corpus": (recipe_with("data.streaming=true"), "data.streaming reads data files or a hub dataset while training", False),
    "streaming without a tokenizer": (streamed_files("text", "data.tokenizer"), "data.streaming needs data.tokenizer", False),
    "streaming without validation files": (streamed_files("text", "data.validation_files"), "data.streaming needs data.validation_files", False),
    "streamed data without its text field": (streamed_files("body"), "data.text_field 'text' is not a field of the streamed data files", False),
    "resume a directory that is not a checkpoint": (resume_from("not a checkpoint"), "is not a complete checkpoint (no COMPLETE marker)", False),
    "resume a missing directory": (resume_from("missing"), "no such checkpoint directory", False),
    "dropout of 1 or more": (recipe_with("model.dropout=1.5"), "model.dropout must be in [0, 1), not 1.5", False),
    "NaN learning rate": (recipe_with("optimizer.lr=.nan"), "optimizer.lr must be a finite number, not nan", False),
    "infinite learning rate": (recipe_with("optimizer.lr=.inf"), "optimizer.lr must be a finite number, not inf", False),
    "beta of 1 or more": (recipe_with("optimizer.betas=[1.5, 0.999]"), "optimizer.betas must each be in [0, 1), not [1.5, 0.999]", False),
    "zero eps": (recipe_with("optimizer.eps=0"), "optimizer.eps must be positive, not 0.0", False),
    "negative seed": (recipe_with("train.seed=-1"), "train.seed must be >= 0, not -1", False),
    "cosine floor above the lr": (recipe_with("schedule.name=cosine", "schedule.min_lr=1"), "schedule.min_lr 1.0 is above optimizer.lr 0.003", False),
    "binary recipe file": (recipe_bytes(bytes(range(256)) * 2), "recipe.yaml is not a text file (YAML in UTF-8); is it the recipe?", False),
    "brackets in the recipe's name": (bracketed_recipe, "gpt2[old][bold].yaml: model.n_embd 128 must be divisible by model.n_head 3", False),
    "missing recipe with brackets": (lambda tmp, cache, run: [str(tmp / "x[/y].yaml")], "x[/y].yaml does not exist", False),
    "negative --max-restarts": (lambda tmp, cache, run: [RECIPE, "--max-restarts", "-1"], "--max-restarts must be 0 or more, not -1", False),
    "missing recipe": (lambda tmp, cache, run: [str(tmp / "nope.yaml")], "nope.yaml does not exist", False),
    "--set without =": (lambda tmp, cache, run: [RECIPE, "--set", "noequals"], "--set 'noequals' must look like section.key=value", False),
    "--reshard without --resume": (lambda tmp, cache, run: [RECIPE, "--reshard"], "--reshard continues a checkpoint at another number of ranks", False),
    "non-empty run directory": (non_empty_run_directory, "is not empty: pass --resume auto to continue it or --overwrite", False),
    "checkpoint of another world size": (checkpoint_of_four_ranks, "was written by 4 ranks and this run has 2", False),
    "zero --nproc": (lambda tmp, cache, run: [RECIPE, "--nproc", "0"], "--nproc must be at least 1, not 0", False),
    # issue 35: what the platform cannot hold, checked once in the schema (plan and run alike); keys given twice
    "a key given twice": (
        recipe_file("model:\n  kind: gpt2\noptimizer:\n  lr: 1.0e-3\noptimizer:\n  lr: 2.0e-3\n"),
        "gives the key optimizer twice in one mapping (lines 3 and 5)",
        False,
    ),
    "--set value that is not YAML": (recipe_with("optimizer.betas=[0.9"), "--set 'optimizer.betas=[0.9': the value is not valid YAML", False),
    "seed beyond 64 bits": (recipe_with("train.seed=12345678901234567890123"), "train.seed must fit in 64 bits", False),
    "timeout beyond a deadline": (recipe_with("train.timeout_s=100000000000000"), "train.timeout_s must be from 1 to 1,000,000,000", False),
    "lr decayed below a float": (recipe_with("train.steps=250000"), "takes the lr from 0.003 to 1.27e-316 by step 250,000", False),
    "run directory that cannot be created": (
        lambda tmp, cache, run: [RECIPE, "--out", str(a_file_in_the_way(tmp) / "run")],
        "cannot create run directory",
        False,
    ),
    "data.cache_dir that cannot be created": (
        lambda tmp, cache, run: [RECIPE, *sets(f"data.cache_dir={a_file_in_the_way(tmp) / 'cache'}")],
        "cannot create data.cache_dir",
        False,
    ),
    # issue 53: the delayed sync, out of range or with what it does not run with, refused at recipe load
    "sync delay of two": (recipe_with("optimizer.sync_delay=2"), "optimizer.sync_delay must be from 0 to 1, not 2", False),
    "sync delay overlapped": (recipe_with("optimizer.sync_delay=1", "comm.overlap=true"), "optimizer.sync_delay 1 lets each 1-bit round run behind", False),
    "DiLoCo's sync delay overlapped": (
        recipe_with("optimizer.name=diloco", "optimizer.sync_delay=1", "comm.overlap=true"),
        "optimizer.sync_delay 1 lets each outer round run behind",
        False,
    ),
    # issue 40: DiLoCo's outer collective and the top-k compressor's settings, refused at recipe load
    "unknown outer collective": (recipe_with("optimizer.outer_collective=twobit"), "optimizer.outer_collective must be one of full, onebit, topk", False),
    "compressed outer sync in fragments": (
        recipe_with("optimizer.name=diloco", "optimizer.outer_collective=onebit", "optimizer.fragments=2"),
        "optimizer.outer_collective onebit averages the whole model at once, so optimizer.fragments must be 1, not 2",
        False,
    ),
    "top-k density of zero": (recipe_with("optimizer.topk_density=0"), "optimizer.topk_density must be in (0, 1], not 0.0", False),
    "top-k error decay above 1": (recipe_with("optimizer.topk_error_decay=1.5"), "optimizer.topk_error_decay must be in [0, 1], not 1.5", False),
    # issue 49: a model is what the recipe names; a local directory that is not there is named missing
    "init_from a model of another family": (init_from("qwen2"), "holds a model of type qwen2 and model.kind gpt2 takes type gpt2", False),
    "init_from a model of another shape": (init_from("gpt2"), "holds a model of n_embd 64, not n_embd 128 as the recipe states", False),
    "init_from a directory that does not exist": (recipe_with("model.init_from=./my-model"), "model.init_from ./my-model does not exist", False),
    "data.tokenizer a directory that does not exist": (recipe_with("data.tokenizer=./tok"), "data.tokenizer ./tok does not exist", False),
    # Unsupported combinations (issue 12, item 8): there is no key for splitting the model; asking for it names the reason.
    "ZeRO stage": (recipe_with("train.zero_stage=2"), "unknown key train.zero_stage; zoa-train shards only inside a node", False),
    "FSDP": (recipe_with("train.fsdp=true"), "unknown key train.fsdp; zoa-train shards only inside a node", False),
    "tensor parallelism": (recipe_with("train.tensor_parallel=2"), "ZeRO across nodes, tensor and pipeline parallelism are not supported", False),
    "pipeline parallelism": (
        recipe_file("model: {kind: gpt2}\ntrain: {pipeline_parallel_size: 4}\n"),
        "unknown key train.pipeline_parallel_size; zoa-train shards only inside a node",
        False,
    ),
    # issue 51: Megatron indexed datasets (data.source megatron), their files checked before any rank starts
    "megatron prefix without its .idx": (megatron_prefix(lambda p: p.with_name("corpus.idx").unlink()), "corpus.idx does not exist", False),
    "megatron index cut short": (megatron_prefix(rewritten(".idx", lambda b: b[:100])), "corpus.idx is truncated", False),
    "megatron data cut short": (megatron_prefix(rewritten(".bin", lambda b: b[:100])), "corpus.bin is truncated", False),
    "megatron index of another version": (megatron_prefix(rewritten(".idx", another_version)), "corpus.idx is an index of version 2", False),
    "megatron index of another format": (megatron_prefix(rewritten(".idx", lambda b: b"PK\x03\x04" + b[4:])), "is not a Megatron index", False),
    "megatron prefix of no tokens": (megatron_prefix(empty_prefix), "which holds no tokens", False),
    "megatron weights that do not match the prefixes": (
        megatron_prefix(None, "data.weights=[0.5, 0.3, 0.2]"),
        "data.weights gives 3 weights for the 1 prefix of data.prefixes",
        False,
    ),
    "megatron weight of zero": (megatron_prefix(None, "data.weights=[0]"), "data.weights must each be positive, not [0.0]", False),
    "megatron without a tokenizer": (megatron_prefix(tokenizer=False), "data.source megatron needs data.tokenizer", False),
    "megatron prefixes with another source": (recipe_with("data.prefixes=[corpus]"), "data.prefixes is read only with data.source megatron", False),
}


def test_the_catalogue_names_cases_that_exist_and_a_case_for_each_message():
    """docs/bad-input.md's rows name cases of the tables here and in tests/test_run.py, whose tests check
    each documented message against what zoa-train says (tests/catalogue.py)."""
    from catalogue import rows
    from test_run import BAD_RECIPES

    tables = {"bad_input": CASES, "commands": COMMAND_CASES, "resume": RESUME_REFUSALS, "BAD_RECIPES": BAD_RECIPES}
    checked = rows()
    assert len(checked) > 40
    for messages, cases in checked:
        assert all(case in tables[kind] for kind, case in cases), cases
        assert 1 <= len(messages) <= len(cases), (messages, cases)  # every message has its case


def contents(run_dir: Path) -> dict[Path, bytes]:
    """Every file of a run directory but its lock (which records the last process to hold it)."""
    return {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if CASES[c][2] else c for c in sorted(CASES)])  # slow: starts ranks
def test_bad_input_exits_2_with_one_sentence(tmp_path, cache_dir, capsys, case):
    make_args, message, starts_ranks = CASES[case]
    run_dir = tmp_path / "run"
    args = make_args(tmp_path, cache_dir, run_dir)
    args = ("run", *args, *([] if "--out" in args else ["--out", str(run_dir)]))
    before = contents(tmp_path)
    done = zoa(*args) if starts_ranks else zoa_here(capsys, *args)
    refused(done, message, alone=not starts_ranks, end="?" if message.endswith("?") else ".")
    check_documented("bad_input", case, done.stderr)
    if starts_ranks:  # they created the new run directory before the data failed them
        assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()
    else:  # refused before anything was written
        assert contents(tmp_path) == before and run_dir.exists() == any(p.is_relative_to(run_dir) for p in before)


def run_with_metrics(line: str, recipe: str = ""):
    """A run directory whose metrics.jsonl holds `line` (and recipe.yaml `recipe`, if given)."""

    def args(tmp):
        (tmp / "run").mkdir()
        (tmp / "run" / "metrics.jsonl").write_text(line + "\n")
        if recipe:
            (tmp / "run" / "recipe.yaml").write_text(recipe)
        return ["report", str(tmp / "run"), "--out", str(tmp / "report")]

    return args


def json_into_a_directory(command: list[str]):
    """An evaluation whose --json names a directory: refused before the checkpoint (which does not exist) is read."""

    def args(tmp):
        (tmp / "results.json").mkdir()
        return [*command, "--checkpoint", str(tmp / "no-checkpoint"), "--data", str(tmp / "no-data"), "--json", str(tmp / "results.json")]

    return args


def deepspeed_config_with(text: str):
    return lambda tmp: (tmp.joinpath("ds.json").write_text(text), ["convert-deepspeed", str(tmp / "ds.json")])[1]


# name: (arguments(tmp_path) -> the whole command line, expected text in the sentence). Every case is refused
# before any work, in this process, and leaves tmp_path as the arguments left it.
COMMAND_CASES = {
    "plan for zero nodes": (lambda tmp: ["plan", RECIPE, "--nodes", "0"], "--nodes must be at least 1, not 0"),
    "plan for negative ranks": (lambda tmp: ["plan", RECIPE, "--world-size", "-2"], "--world-size must be at least 1, not -2"),
    "plan for nodes of no GPU": (lambda tmp: ["plan", RECIPE, "--gpus-per-node", "0"], "--gpus-per-node must be at least 1, not 0"),
    "plan for GPU memory that is not an amount": (lambda tmp: ["plan", RECIPE, "--gpu-memory", "80Gb"], "GPU memory '80Gb' is not understood"),
    "bench comm without GPUs for nccl": (lambda tmp: ["bench", "comm", "--backend", "nccl", "--sizes", "1k"], "--backend nccl needs a GPU for each of the 2"),
    "bench comm of more memory than there is": (lambda tmp: ["bench", "comm", "--sizes", "1024G"], "--sizes 1,099,511,627,776 elements need about"),
    "report on records that are not objects": (run_with_metrics("[1, 2]"), "metrics.jsonl line 1 is a JSON list, not an object"),
    "report on a record of another kind": (run_with_metrics('{"step": 1, "loss": "low"}'), 'metrics.jsonl line 1 has loss "low", which is not a number'),
    "report on a recipe with a key twice": (
        run_with_metrics('{"step": 1, "loss": 2.0}', "optimizer: {name: adam}\noptimizer: {name: zero_one_adam}\n"),
        "recipe.yaml gives the key optimizer twice in one mapping (lines 1 and 2)",
    ),
    "report into a file": (
        lambda tmp: (a_file_in_the_way(tmp), ["report", str(tmp), "--out", str(tmp / "file" / "report")])[1],
        "cannot create report directory",
    ),
    "eval wikitext --json into a directory": (json_into_a_directory(["eval", "wikitext"]), "--json …/results.json is a directory"),
    "eval lambada --json into a directory": (json_into_a_directory(["eval", "lambada"]), "results.json is a directory; name the file to write"),
    "eval imagenet --json into a directory": (json_into_a_directory(["eval", "imagenet"]), "results.json is a directory; name the file to write"),
    "eval glue --json where no directory can be made": (
        lambda tmp: ["eval", "glue", "--checkpoint", str(tmp), "--task", "rte", "--json", str(a_file_in_the_way(tmp) / "glue.json")],
        "cannot write --json …/file/glue.json: …/file is not a directory",
    ),
    "export into a file": (lambda tmp: ["export", str(tmp), str(a_file_in_the_way(tmp) / "hf")], "cannot create output directory"),
    # issue 49: what differs, and the evaluations that fit
    "export of a checkpoint its recipe no longer describes": (
        lambda tmp: ["export", str(gpt2_tiny_run(tmp, recipe_n_layer=3)), str(tmp / "hf")],
        "does not fit the model that",
    ),
    "eval imagenet of a language run": (
        lambda tmp: ["eval", "imagenet", "--checkpoint", str(gpt2_tiny_run(tmp)), "--data", str(tmp)],
        "trains a GPT-2 model (a causal LM) and eval imagenet evaluates image classifiers",
    ),
    "DeepSpeed config with a key twice": (
        deepspeed_config_with('{"optimizer": {"type": "Adam"}, "optimizer": {"type": "OneBitAdam"}}'),
        "ds.json gives the key optimizer twice in one object; keep one",
    ),
    # issue 49: every number of every bench command bounded, and checked against the memory before anything is allocated
    "bench optim of NaN parameters": (
        lambda tmp: ["bench", "optim", "--params-millions", "nan"],
        "--params-millions must be a positive finite number, not nan",
    ),
    "bench optim of infinite parameters": (
        lambda tmp: ["bench", "optim", "--params-millions", "inf"],
        "--params-millions must be a positive finite number, not inf",
    ),
    "bench optim of more memory than there is": (
        lambda tmp: ["bench", "optim", "--params-millions", "1e6"],
        "1,000,000,000,000 parameters (--params-millions 1e+06) need about",
    ),
    "bench optim repeated beyond bounds": (lambda tmp: ["bench", "optim", "--repeats", "100000"], "--repeats must be from 1 to 10,000, not 100,000"),
    "bench optim on more threads than cores": (lambda tmp: ["bench", "optim", "--threads", "100000"], "--threads must be from 0 to"),
    "bench ops of more ranks than memory": (lambda tmp: ["bench", "ops", "--nproc", "100000"], "--nproc 100,000 ranks need about"),
    "bench ops of too many calls": (lambda tmp: ["bench", "ops", "--calls", "100000"], "--calls must be from 1 to 10,000, not 100,000"),
    "bench ops of a scale beyond the largest tensor": (
        lambda tmp: ["bench", "ops", "--scale", "1000000000000"],
        "--scale must be from 1 to 31,254,528, not 1,000,000,000,000",
    ),
    "bench comm repeated beyond bounds": (lambda tmp: ["bench", "comm", "--repeats", "100000"], "--repeats must be from 1 to 10,000, not 100,000"),
    "bench loader of too many batches": (lambda tmp: ["bench", "loader", RECIPE, "--batches", "100000"], "--batches must be from 1 to 10,000, not 100,000"),
    "bench netsim of more memory than there is": (
        lambda tmp: ["bench", "netsim", "--comm-sizes", "1024G"],
        "--comm-sizes 1,099,511,627,776 elements need about",
    ),
    "bench netsim over a link faster than tc can shape": (
        lambda tmp: ["bench", "netsim", "--bandwidth", "100Tbit"],
        "--bandwidth 100Tbit is more than the 1 Tbit/s an emulated link can be given",
    ),
    "bench netsim of a latency above 10 s": (
        lambda tmp: ["bench", "netsim", "--latency", "100s"],
        "--latency 100s is more than the 10 s an emulated link can be given",
    ),
}


@pytest.mark.parametrize("case", sorted(COMMAND_CASES))
def test_every_command_refuses_bad_input_in_one_sentence_before_any_work(tmp_path, capsys, case):
    import torch

    if case == "bench comm without GPUs for nccl" and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs that 2 NCCL ranks need: nothing to refuse")
    make_args, message = COMMAND_CASES[case]
    args = make_args(tmp_path)
    before = contents(tmp_path), sorted(tmp_path.rglob("*"))
    done = zoa_here(capsys, *args)
    refused(done, message.replace("…", str(tmp_path)))
    check_documented("commands", case, done.stderr)
    assert (contents(tmp_path), sorted(tmp_path.rglob("*"))) == before  # not a file or directory more


@pytest.mark.parametrize(
    "device,message", [("tpu", "--device must be cpu, cuda or cuda:N, not 'tpu'"), ("meta", "--device meta: this machine has no such device")]
)
def test_bench_optim_refuses_a_device_it_cannot_time(capsys, device, message):
    refused(zoa_here(capsys, "bench", "optim", "--device", device), message)


# ---- a refused resume leaves the run directory as it was (issue 35) --------------------------------
# Every check that can refuse a resume runs before anything in the run directory changes. The run is
# one rank in this process (a launcher's environment: nothing to start), resumed from its first of two
# checkpoints, so a metrics.jsonl trimmed too early would lose step 2's record.


@pytest.fixture
def one_rank(monkeypatch):
    """This process as the only rank of a launcher's group: `zoa-train run` trains here."""
    import torch
    from distributed_harness import free_port

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory, cache_dir) -> Path:
    """A finished 2-step run of one rank with a checkpoint at each step, trained in this process."""
    import torch
    from distributed_harness import free_port

    from zoa_train import cli

    run_dir = tmp_path_factory.mktemp("one-rank") / "run"
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.setattr(sys, "argv", ["zoa-train", "run", RECIPE, "--out", str(run_dir), *quick(cache_dir, "train.checkpoint_every=1")])
        with pytest.raises(SystemExit) as done:
            cli.run()
    torch.set_num_threads(threads)
    assert done.value.code == 0
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    return run_dir


def pickled_rank_file(run_dir: Path) -> None:
    """rank_00000.pt rewritten, with its checksum, to hold an object that runs code when unpickled."""
    import hashlib

    import torch

    checkpoint = run_dir / "checkpoints" / "step_00000001"
    rank_file = checkpoint / "rank_00000.pt"
    torch.save({"payload": PickledCall(run_dir.parent / "called")}, rank_file)
    data = rank_file.read_bytes()
    marker = checkpoint / "COMPLETE"
    lines = [f"file rank_00000.pt {len(data)} {hashlib.sha256(data).hexdigest()}" if line.startswith("file rank_00000.pt ") else line
             for line in marker.read_text().splitlines()]  # fmt: skip
    marker.write_text("\n".join(lines) + "\n")


def recipe_unrecorded(run_dir: Path) -> None:
    """The run as an older zoa-train wrote it: no recipe in trainer.pt (nor, here, a recipe.yaml beside it)."""
    import hashlib

    import torch

    checkpoint = run_dir / "checkpoints" / "step_00000001"
    trainer = torch.load(checkpoint / "trainer.pt", weights_only=True)
    del trainer["recipe"], trainer["recipe_changes"]
    torch.save(trainer, checkpoint / "trainer.pt")
    data = (checkpoint / "trainer.pt").read_bytes()
    marker = checkpoint / "COMPLETE"
    lines = [f"file trainer.pt {len(data)} {hashlib.sha256(data).hexdigest()}" if line.startswith("file trainer.pt ") else line
             for line in marker.read_text().splitlines()]  # fmt: skip
    marker.write_text("\n".join(lines) + "\n")
    (run_dir / "recipe.yaml").unlink()


def damaged_model_file(run_dir: Path) -> None:
    model = run_dir / "checkpoints" / "step_00000001" / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))


# name: (how the run directory is spoiled first, or None; what the resume sets; the sentence's words)
RESUME_REFUSALS = {
    "another model": (None, ["model.n_layer=3"], "with model.n_layer 3: the checkpoint was trained with 2"),
    "another optimizer": (None, ["optimizer.name=onebit_adam"], "with optimizer.name onebit_adam: the checkpoint was trained with zero_one_adam"),
    "another task": (None, ["model.kind=bert"], "with model.kind bert: the checkpoint was trained with gpt2"),
    "another seed": (None, ["train.seed=1"], "with train.seed 1: the checkpoint was trained with 0"),
    "a checkpoint without its recipe": (recipe_unrecorded, ["model.n_layer=3"], "holds another model (12 tensors missing"),
    "a damaged checkpoint": (damaged_model_file, [], "model.pt does not match the SHA-256 checksum recorded when it was written"),
    "a pickled object": (pickled_rank_file, [], "rank_00000.pt holds a pickled"),
}


@pytest.mark.slow  # one_rank_run trains first
@pytest.mark.parametrize("case", sorted(RESUME_REFUSALS))
def test_a_refused_resume_leaves_the_run_directory_as_it_was(one_rank_run, tmp_path, cache_dir, capsys, one_rank, case):
    import shutil

    spoil, settings, message = RESUME_REFUSALS[case]
    run_dir = tmp_path / "run"
    shutil.copytree(one_rank_run, run_dir)
    if spoil is not None:
        spoil(run_dir)
    before = contents(run_dir)
    checkpoint = run_dir / "checkpoints" / "step_00000001"
    done = zoa_here(capsys, "run", RECIPE, "--out", str(run_dir), "--resume", str(checkpoint), *quick(cache_dir, "train.steps=3", *settings))
    refused(done, message)
    check_documented("resume", case, done.stderr)
    assert contents(run_dir) == before
    assert not (tmp_path / "called").exists()


# ---- unsupported combinations with the 1-bit optimizers (issue 12, item 8) ----------------------
# No recipe makes sparse gradients or freezes parameters, so these go through the library interface
# the trainer uses (registry.create), on one process; inside a run the UserError is exit 2 like any other.


def small_model(sparse: bool = False):
    import torch

    torch.manual_seed(0)
    return torch.nn.ModuleDict({"embed": torch.nn.Embedding(10, 4, sparse=sparse), "head": torch.nn.Linear(4, 3)})


def train_step(model, opt) -> None:
    import torch

    tokens = torch.tensor([1, 2, 3, 4])
    model["head"](model["embed"](tokens)).square().mean().backward()
    opt.step()
    opt.optimizer.zero_grad(set_to_none=True)


def build(model, name: str):
    import torch

    from zoa_train.config import recipe_from_dict
    from zoa_train.optim import registry

    return registry.create(recipe_from_dict({"optimizer": {"name": name}}).optimizer, model, torch.device("cpu"), 1)


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam"])
def test_one_bit_optimizers_refuse_sparse_gradients_up_front(name):
    from zoa_train.errors import UserError

    with pytest.raises(UserError, match=r"cannot train embed: it makes sparse gradients \(sparse=True\)"):
        build(small_model(sparse=True), name)
    # A sparse gradient from anywhere else is refused at the step that meets it.
    model = small_model()
    opt = build(model, name)
    model["head"].weight.grad = model["head"].weight.detach().clone().to_sparse()
    with pytest.raises(UserError, match="parameter head.weight has a sparse gradient"):
        opt.step()


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam"])
def test_one_bit_optimizers_refuse_a_trainable_set_changed_after_the_build(name):
    import torch

    from zoa_train.errors import UserError

    # Frozen before the build: left out of the optimizer, trained around, never changed.
    model = small_model()
    model["embed"].weight.requires_grad_(False)
    frozen = model["embed"].weight.detach().clone()
    opt = build(model, name)
    for _ in range(3):
        train_step(model, opt)
    assert torch.equal(model["embed"].weight, frozen)
    # Unfrozen later: refused at the next step, before anything moves.
    model["embed"].weight.requires_grad_(True)
    head = model["head"].weight.detach().clone()
    with pytest.raises(UserError, match=r"parameter embed.weight was unfrozen \(requires_grad set to True\) after " + name):
        train_step(model, opt)
    assert torch.equal(model["head"].weight, head)
    # Frozen later: refused too (its momentum would keep moving it).
    model = small_model()
    opt = build(model, name)
    train_step(model, opt)
    model["head"].bias.requires_grad_(False)
    with pytest.raises(UserError, match="parameter head.bias was frozen"):
        train_step(model, opt)


def test_a_run_directory_with_brackets_is_named_as_it_is(tmp_path, capsys):
    run_dir = tmp_path / "runs[old]"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("kept")
    done = zoa_here(capsys, "run", RECIPE, "--out", str(run_dir))
    refused(done, f"{run_dir} is not empty")
    assert (run_dir / "notes.txt").read_text() == "kept"


class PickledCall:
    """Unpickled with torch's full unpickler, this would call os.system and create `path` (checkpoints
    are read with torch's weights-only unpickler, which refuses it)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.path}",)


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(lr=-1.0), "lr must be >= 0, got -1.0"), (dict(betas=(1.5, 0.999)), "betas must be two numbers in [0, 1)"), (dict(eps=-1.0), "eps must be >= 0")],
)
@pytest.mark.parametrize("name", ["ZeroOneAdam", "OneBitAdam", "DataParallelAdam"])
def test_the_library_refuses_what_torch_optim_refuses(name, kwargs, message):
    import torch

    from zoa_train import optim

    with pytest.raises(ValueError, match=re.escape(f"{name}: {message}")):
        getattr(optim, name)([torch.nn.Parameter(torch.zeros(4))], **kwargs)


@pytest.mark.parametrize("name", ["ZeroOneAdam", "OneBitAdam", "DataParallelAdam"])
def test_the_library_names_a_sparse_gradient(name):
    import torch

    from zoa_train import optim

    embedding = torch.nn.Embedding(10, 4, sparse=True)
    opt = getattr(optim, name)(embedding.parameters(), lr=0.1)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="a parameter has a sparse gradient, which these optimizers do not support"):
        opt.step()


# ---- library misuse, in the project's words (issue 35) ----------------------------------------------


def _parameters(case: str):
    import torch

    return {
        "frozen": lambda: [torch.nn.Parameter(torch.zeros(3), requires_grad=False)],
        "zero-size": lambda: [torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(2, 0))],
        "frozen and zero-size": lambda: [torch.nn.Parameter(torch.zeros(3), requires_grad=False), torch.nn.Parameter(torch.zeros(0))],
        "empty groups": lambda: [{"params": []}, {"params": []}],
    }[case]()


@pytest.mark.parametrize("case", ["frozen", "zero-size", "frozen and zero-size", "empty groups"])
@pytest.mark.parametrize("name", ["ZeroOneAdam", "OneBitAdam", "DataParallelAdam", "DiLoCo"])
def test_an_optimizer_over_nothing_trainable_is_refused(name, case):
    from zoa_train.optim import DataParallelAdam, OneBitAdam, ZeroOneAdam
    from zoa_train.optim.diloco import DiLoCo

    cls = {"ZeroOneAdam": ZeroOneAdam, "OneBitAdam": OneBitAdam, "DataParallelAdam": DataParallelAdam, "DiLoCo": DiLoCo}[name]
    with pytest.raises(ValueError, match=rf"^{name} has nothing to train: .*; pass the trainable ones"):
        cls(_parameters(case), lr=0.01)


def every_dtype():
    """Every dtype torch has a zeros() for, the ones it may add later included."""
    import warnings

    import torch

    found = []
    for name in dir(torch):
        dtype = getattr(torch, name)
        if isinstance(dtype, torch.dtype) and dtype not in found:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # experimental and deprecated dtypes say so
                    torch.zeros(1, dtype=dtype)
            except (RuntimeError, TypeError):  # quantized and other dtypes without plain tensors
                continue
            found.append(dtype)
    return found


def test_the_1bit_collectives_refuse_every_dtype_they_cannot_average():
    import torch

    from zoa_train.comm import OneBitAllReduce
    from zoa_train.comm.onebit import ONEBIT_DTYPES

    dtypes = every_dtype()
    assert set(ONEBIT_DTYPES) < set(dtypes) and torch.float64 in dtypes and torch.int64 in dtypes
    comm = OneBitAllReduce([[5], [3]])
    for dtype in dtypes:
        pair = [torch.zeros(5, dtype=dtype), torch.zeros(3, dtype=dtype)]
        if dtype in ONEBIT_DTYPES:
            assert comm.op(pair)[0].dtype == dtype
            continue
        for call in (comm.op, comm.exchange):
            with pytest.raises(ValueError, match=rf"^OneBitAllReduce averages float32, bfloat16 or float16 tensors, not {dtype}$"):
                call(pair)


@pytest.mark.parametrize("sizes", [-1, [4, -3], [[4], [-3]]])
def test_a_1bit_collective_of_negative_size_is_refused(sizes):
    from zoa_train.comm import OneBitAllReduce

    with pytest.raises(ValueError, match=r"^a 1-bit allreduce lays out tensors of 0 or more elements, not -\d$"):
        OneBitAllReduce(sizes)


@pytest.mark.slow  # a 2-step run
def test_run_warns_of_a_setting_too_few_outer_steps_train(one_rank, tmp_path, cache_dir, capsys, caplog):
    """The recipe's own optimizer's plan warning, said once by rank 0 before training (plan: tests/test_plan.py)."""
    done = zoa_here(capsys, "run", RECIPE, "--out", str(tmp_path / "run"), *quick(cache_dir, "optimizer.name=diloco"))
    assert done.returncode == 0, done.stderr
    said = [r.getMessage() for r in caplog.records if "outer step(s), too few to train" in r.getMessage()]
    assert said == ["optimizer.sync_every (500) leaves this run of 2 steps 0 outer step(s), too few to train (2 ended 8% above Adam on gpt2_tiny; "
                    "bert_tiny reached Adam's loss with 9, docs/results/baselines.md): train at least 8 steps (one outer step each at sync_every 1)."]  # fmt: skip


@pytest.mark.slow  # one_rank_run trains first
def test_a_resume_refused_by_the_ranks_into_a_new_directory_leaves_no_directory(one_rank_run, tmp_path, cache_dir, capsys, one_rank):
    """The ranks create and lock --out before they read the checkpoint: refused there, nothing is left (not even .lock)."""
    checkpoint = one_rank_run / "checkpoints" / "step_00000001"
    done = zoa_here(capsys, "run", RECIPE, "--out", str(tmp_path / "new"), "--resume", str(checkpoint), *quick(cache_dir, "train.steps=3", "train.seed=1"))
    refused(done, "with train.seed 1", alone=False)
    assert not (tmp_path / "new").exists()


@pytest.mark.slow  # a 2-step run
def test_run_says_which_comm_keys_do_nothing_without_1bit_rounds(one_rank, tmp_path, cache_dir, capsys, caplog):
    done = zoa_here(capsys, "run", RECIPE, "--out", str(tmp_path / "run"), *quick(cache_dir, "optimizer.name=adam", "comm.kernels=torch", "comm.overlap=true"))
    assert done.returncode == 0, done.stderr
    said = [r.getMessage() for r in caplog.records if "no effect on this run" in r.getMessage()]
    assert said == [
        "comm.kernels and comm.overlap have no effect on this run: optimizer adam sends no 1-bit rounds here (only the 1-bit optimizers' rounds and outer_collective onebit use them)"
    ]
