#!/usr/bin/env python
"""Published layouts at their real scale, each rank role dry-run beside the planner's estimate:
tools/plan_parallelism.py --verify's measure (one rank of each distinct pipeline role as
pretrain_gpt.py --fake-process-group --no-storage, its first step's peak by category) for

- GPT-3 175B on 1,024 GPUs: Megatron's TP8 x PP16, interleaved (2 chunks of 3 layers per rank), bf16;
- Llama-2 70B on 64 GPUs: examples/llama2_70b_args.sh's TP8 x PP4 (4 chunks of 5 layers) x DP2;
- Llama-3.1 405B on 16,384 GPUs: TP8 x PP16 x CP4 x DP32, 126 layers split by
  --pipeline-model-parallel-layout (embedding + 7 layers, 14 stages of 8, 7 layers + loss);
- DeepSeek-V3 671B on 1,024 GPUs: examples/pretrain_deepseek_v3.sh's TP2 x PP16 (2 virtual stages,
  the MTP depth with the loss) x EP64, full recomputation;
- Mixtral 8x22B on 256 GPUs with EP8: the planner's fastest layout with 8 expert-parallel ranks.

Baselines: the planner's estimate of the same rank (the ratio is its error on the peak), and 80 GB
devices (the figure's share of them). The seconds are the dry runs' wall time on this machine. And on a
layout that fits this machine (a ~0.7B model at TP2 x PP2 x DP2), each role's peak in a real 8-process
run beside its dry runs with and without storage.

    python bench/bench_layouts.py             # writes bench/RESULTS.md
    python bench/bench_layouts.py --quick     # the 70B layout only
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

GPU_MEMORY_GB = 80
LLAMA = ["--swiglu", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--disable-bias-linear", "--group-query-attention", "--attention-dropout", "0",
         "--hidden-dropout", "0"]
# name -> the planner's flags (model, batch, GPUs and the pinned layout)
LAYOUTS = {
    "GPT-3 175B, 1,024 GPUs": [
        "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--vocab-size", "50257",
        "--seq-length", "2048", "--max-position-embeddings", "2048", "--attention-dropout", "0.1", "--hidden-dropout",
        "0.1", "--num-gpus", "1024", "--global-batch-size", "1536", "--tensor-model-parallel-size", "8",
        "--pipeline-model-parallel-size", "16", "--num-layers-per-virtual-pipeline-stage", "3", "--micro-batch-size",
        "1", "--use-distributed-optimizer", "--recompute-granularity", "selective"],
    "Llama-2 70B, 64 GPUs": LLAMA + [
        "--num-layers", "80", "--hidden-size", "8192", "--ffn-hidden-size", "28672", "--num-attention-heads", "64",
        "--num-query-groups", "8", "--vocab-size", "32000", "--seq-length", "4096", "--num-gpus", "64",
        "--global-batch-size", "1024", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
        "--num-layers-per-virtual-pipeline-stage", "5", "--micro-batch-size", "1", "--use-distributed-optimizer",
        "--recompute-granularity", "selective"],
    "Llama-3.1 405B, 16,384 GPUs": LLAMA + [
        "--num-layers", "126", "--hidden-size", "16384", "--ffn-hidden-size", "53248", "--num-attention-heads", "128",
        "--num-query-groups", "8", "--vocab-size", "128256", "--seq-length", "8192", "--num-gpus", "16384",
        "--global-batch-size", "512", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
        "--context-parallel-size", "4", "--pipeline-model-parallel-layout", "Et*7|(t*8|)*14t*7,L",
        "--micro-batch-size", "1", "--use-distributed-optimizer", "--recompute-granularity", "none"],
    "DeepSeek-V3 671B, 1,024 GPUs": [
        "--num-layers", "61", "--hidden-size", "7168", "--ffn-hidden-size", "18432", "--num-attention-heads", "128",
        "--kv-channels", "128", "--swiglu", "--untie-embeddings-and-output-weights", "--position-embedding-type",
        "rope", "--normalization", "RMSNorm", "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout",
        "0", "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "1536", "--kv-lora-rank", "512",
        "--qk-head-dim", "128", "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--rotary-scaling-factor", "40",
        "--mscale", "1.0", "--mscale-all-dim", "1.0", "--num-experts", "256", "--moe-layer-freq", "([0]*3+[1]*58)",
        "--moe-ffn-hidden-size", "2048", "--moe-shared-expert-intermediate-size", "2048", "--moe-router-topk", "8",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-num-groups", "8",
        "--moe-router-group-topk", "4", "--moe-router-topk-scaling-factor", "2.5", "--moe-token-dispatcher-type",
        "alltoall", "--mtp-num-layers", "1", "--vocab-size", "129280", "--make-vocab-size-divisible-by", "3232",
        "--seq-length", "4096", "--num-gpus", "1024", "--global-batch-size", "8192", "--tensor-model-parallel-size",
        "2", "--sequence-parallel", "--pipeline-model-parallel-size", "16", "--pipeline-model-parallel-layout",
        "Et*2|(tt|)*29,t|mL", "--expert-model-parallel-size", "64", "--expert-tensor-parallel-size", "1",
        "--micro-batch-size", "1", "--use-distributed-optimizer", "--recompute-granularity", "full"],
    "Mixtral 8x22B EP8, 256 GPUs": LLAMA + [
        "--num-layers", "56", "--hidden-size", "6144", "--ffn-hidden-size", "16384", "--num-attention-heads", "48",
        "--num-query-groups", "8", "--vocab-size", "32768", "--num-experts", "8", "--moe-router-topk", "2",
        "--moe-token-dispatcher-type", "alltoall", "--seq-length", "4096", "--num-gpus", "256",
        "--global-batch-size", "256", "--expert-model-parallel-size", "8"],
}


# Agreement on a layout that fits this machine: the ~0.7B bf16 Llama (12 layers, hidden 2048, GQA 16/4,
# vocab 31999) at TP2 x PP2 x DP2 with ZeRO-3 (so that eight ranks fit), 512-token sequences
AGREEMENT_ARGS = [
    "--num-layers", "12", "--hidden-size", "2048", "--ffn-hidden-size", "5632", "--num-attention-heads", "16",
    "--group-query-attention", "--num-query-groups", "4", "--seq-length", "512", "--max-position-embeddings", "512",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--bf16",
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
    "--data-parallel-sharding-strategy", "optim_grads_params", "--micro-batch-size", "1", "--global-batch-size", "8",
    "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "31999",
    "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0"]
AGREEMENT_RANKS = (0, 7)           # the first and the last pipeline stage


def agreement() -> dict:
    """Each role's peak in a real 8-process run (--log-memory-breakdown), and in its dry runs with and
    without storage."""
    import subprocess
    from megalite.train.memory_account import parse_breakdowns
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}, "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "offline"}
    script = os.path.join(ROOT, "pretrain_gpt.py")

    def peaks(cmd: list[str]) -> dict:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        return {rank: b["peak"] for rank, b in parse_breakdowns(proc.stdout).items()}
    real = peaks([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8", script,
                  *AGREEMENT_ARGS, "--log-memory-breakdown"])
    dry = {mode: {rank: peaks([sys.executable, script, *AGREEMENT_ARGS, "--fake-process-group", "--fake-world-size",
                               "8", "--fake-rank", str(rank), *extra])[rank] for rank in AGREEMENT_RANKS}
           for mode, extra in (("real tensors", []), ("no storage", ["--no-storage"]))}
    return {"real": real, **dry}


def measure(name: str) -> dict:
    """The planner's top layout for ``name`` and its roles' checks (megalite.planning.verify)."""
    import plan_parallelism
    from megalite.planning import verify
    from megalite.planning.flags import pretrain_flags
    args = plan_parallelism.build_parser().parse_args(LAYOUTS[name] + ["--gpu-memory-gb", str(GPU_MEMORY_GB),
                                                                         "--top", "1"])
    workload, hardware, (estimate,) = plan_parallelism.plan(args)
    start = time.perf_counter()
    checks = verify.verify(workload, estimate.layout, log=lambda line: print(f"{name}: {line.strip()}", flush=True))
    return {"layout": estimate.layout, "flags": " ".join(pretrain_flags(workload, estimate.layout)),
            "checks": checks, "seconds": time.perf_counter() - start, "usable": hardware.usable_bytes}


def table(result: dict) -> list[str]:
    gib = 2 ** 30
    rows = ["| rank | role | weights | grads | optimizer state | activations | peak: plan / dry run | error | "
            f"of {GPU_MEMORY_GB} GB |", "|---|---|---|---|---|---|---|---|---|"]
    for c in result["checks"]:
        cells = " | ".join(f"{c.estimate[k] / gib:.2f} / {c.measured[k] / gib:.2f}"
                           for k in ("weights", "grads", "optimizer", "activations", "total"))
        rows.append(f"| {c.role.rank:,} | {c.role.name} | {cells} | {100 * c.error:+.1f}% | "
                    f"{100 * c.measured['total'] / (GPU_MEMORY_GB * gib):.0f}% |")
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    args = parser.parse_args(argv)
    command = command_line("bench_layouts.py", argv)
    names = ["Llama-2 70B, 64 GPUs"] if args.quick else list(LAYOUTS)
    results = {name: measure(name) for name in names}
    body = ["Per role: GB (2^30 bytes) the planner estimates / the dry run measures at the step's peak. Weights: "
            "parameters (+ ZeRO-3's gathered ones); grads: the fp32 gradient buffer (+ reduction buffers); "
            "activations: what forward keeps + backward's temporaries. Each dry run is a step of as many "
            "micro-batches as reach the peak (verify.peak_microbatches). The last column: the measured peak "
            f"as a share of an {GPU_MEMORY_GB} GB device."]
    for name, result in results.items():
        body += ["", f"**{name}** (`{result['flags']}`): {len(result['checks'])} roles dry-run in "
                 f"{result['seconds']:.0f} s", "", *table(result)]
    if not args.quick:
        agree = agreement()
        body += ["", "**Agreement on a layout that fits this machine**: the ~0.7B bf16 Llama at TP2 x PP2 x DP2 "
                 "(ZeRO-3, 512-token sequences), each role's peak in bytes in a real 8-process run (torchrun, gloo, "
                 "`--log-memory-breakdown`) and in its dry runs:", "",
                 "| rank | real run | dry run, real tensors | dry run, no storage | no storage / real run |",
                 "|---|---|---|---|---|",
                 *[f"| {r} | {agree['real'][r]:,} | {agree['real tensors'][r]:,} | {agree['no storage'][r]:,} | "
                   f"{agree['no storage'][r] / agree['real'][r]:.4f} |" for r in AGREEMENT_RANKS]]
    worst = max((abs(c.error), name) for name, r in results.items() for c in r["checks"])
    headlines = [Headline("planner's peak estimate vs dry run, worst role of the published layouts",
                          f"the dry run ({worst[1]})", f"{100 * worst[0]:.1f}% off (goal: at most 10%)", command)]
    if "Llama-3.1 405B, 16,384 GPUs" in results:
        r = results["Llama-3.1 405B, 16,384 GPUs"]
        headlines.append(Headline("Llama-3.1 405B at world 16,384: every role's dry run (no storage)",
                                  "none (goal: at most 10 min in total)",
                                  f"{r['seconds']:.0f} s for {len(r['checks'])} roles", command))
    publish(args, "bench_layouts", "Layouts at scale: dry runs beside the planner", command, headlines, body)


if __name__ == "__main__":
    main(sys.argv[1:])
