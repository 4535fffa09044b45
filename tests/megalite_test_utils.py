"""Shared test constants: tiny model command lines and a flag editor."""
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
