"""Shared test constants and helpers: tiny model command lines, a flag editor, masked micro-batches, an
in-process pretraining run and its log fields."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_LLAMA_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32", "--max-position-embeddings", "32",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "4",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--log-interval", "1",
    "--eval-iters", "0", "--num-workers", "0",
]

TINY_GPT2_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "64", "--openai-gelu", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "4",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--log-interval", "1",
    "--eval-iters", "0", "--num-workers", "0",
]


def with_flags(base: list[str], **overrides) -> list[str]:
    """Copy of ``base`` with ``--flag value`` pairs replaced/added; value None removes, True adds a switch."""
    argv = list(base)
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        if flag in argv:
            i = argv.index(flag)
            takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            del argv[i:i + (2 if takes_value else 1)]
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv


def wandb_offline_history(run_dir: str) -> bytes:
    """The bytes of the one offline run file under run_dir, once wandb's service has written all of it.

    run.finish() returns when the service has the run's records, not when its writer has flushed them to
    the file (a slow machine showed only the 7-byte header). wandb.teardown() waits for the service
    process to exit, so every record is on disk."""
    import glob
    import wandb
    wandb.teardown()
    history = glob.glob(os.path.join(run_dir, "**", "offline-run-*", "run-*.wandb"), recursive=True)
    assert len(history) == 1, history
    with open(history[0], "rb") as f:
        return f.read()


# a ramp-up run: batches 2, 2, 4, 6, 8, ... over 12 samples; warm-up 2 and decay 6 iterations of 8 samples
RAMPUP_ARGS = with_flags(TINY_LLAMA_ARGS, micro_batch_size=1, global_batch_size=8, train_iters=8, lr_warmup_iters=2,
                         lr_decay_iters=6, lr_decay_style="linear", lr="1e-3", min_lr="1e-4") + \
    ["--rampup-batch-size", "2", "2", "12"]

TOKEN_COUNTS = [64, 9, 40, 3]          # of 2 x 32 tokens in each of masked_micro_batches' 4 micro-batches


def masked_micro_batches(seq: int = 32, vocab: int = 200) -> list[dict]:
    """4 micro-batches of 2 sequences (TINY_LLAMA_ARGS' shapes) whose loss masks keep TOKEN_COUNTS tokens."""
    import torch
    g = torch.Generator().manual_seed(3)
    out = []
    for count in TOKEN_COUNTS:
        mask = torch.zeros(2 * seq)
        mask[torch.randperm(2 * seq, generator=g)[:count]] = 1.0
        out.append({"tokens": torch.randint(0, vocab, (2, seq), generator=g),
                    "labels": torch.randint(0, vocab, (2, seq), generator=g),
                    "loss_mask": mask.view(2, seq), "position_ids": torch.arange(seq).expand(2, seq)})
    return out


def run_pretrain(argv: list[str], world_size: int = 1) -> tuple[object, str]:
    """pretrain in this process; (its final state, its log)."""
    from megalite.train.command_line import parse_args
    from megalite.train.trainer import pretrain
    lines = []
    state = pretrain(parse_args(argv, world_size=world_size), print_fn=lines.append)
    return state, "\n".join(lines)


def log_field(log: str, iteration: int, name: str) -> float:
    """The value of ``name`` in the log line of ``iteration``."""
    for line in log.splitlines():
        if f" iteration {iteration:8d}/" in line:
            return float(line.split(f" {name}: ")[1].split(" |")[0])
    raise AssertionError(f"no line for iteration {iteration}")
