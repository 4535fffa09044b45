"""Data-loader workers hold none of the rank's model or optimizer pages, on the user's default path.

A worker forked from a rank shares its pages copy-on-write; each optimizer step then writes every page of
the rank's state, the rank gets fresh copies, and the worker keeps the stale ones: with 2 workers a rank's
state is held about twice over. Here pretrain_gpt.py runs a ~78M-parameter ZeRO-3 model at DP=2 with the
default 2 workers. Every process below a rank must peak within the PSS of a bare interpreter that imports
torch, measured in the same test, plus 64 MiB (process_memory.py): a worker holding a stale share of the
rank's state (about 0.3 GiB a worker here) exceeds it."""
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from process_memory import assert_workers_hold_no_rank_state, run_pretrain_measured

MODEL = dict(num_layers=4, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=8, num_query_groups=2,
             vocab_size=16383, seq_length=8, max_position_embeddings=8)
ARGV = with_flags(TINY_LLAMA_ARGS, **MODEL, bf16=True, micro_batch_size=1, global_batch_size=4, lr=1e-4,
                  train_iters=4, data_parallel_sharding_strategy="optim_grads_params", num_workers=None)


def test_loader_workers_hold_no_copy_of_the_rank_state():
    run = run_pretrain_measured(2, ARGV)
    assert run.returncode == 0 and "iteration        4/" in run.stdout, run.stdout[-3000:]
    assert sorted(run.rank_peak_rss) == [0, 1]
    assert_workers_hold_no_rank_state(run.helper_peak_pss, workers=2 * 2)
