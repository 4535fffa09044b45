#!/usr/bin/env python
"""Multi-latent attention: forward + backward time and activation memory of megalite's MLA against
grouped-query attention with the same parameter count, and against transformers' DeepseekV3Attention
holding the same weights, side by side in one run (model/attention/mla.py).

The MLA is DeepSeek-V3's shape scaled down (q-LoRA, a 128-wide KV latent, 64 + 32 query/key dims, 64 value
dims); its q-LoRA rank is chosen so that its parameters equal the GQA layer's (same hidden size, heads and
head dim, 4 KV groups) within a fraction of a percent. Memory is what a training step holds between forward
and backward -- the storages autograd saves (torch.autograd.graph.saved_tensors_hooks, weights excluded) --
and the forward's peak of live tensors created by its ops (LiveBytes). Time is the fastest of the repeats
after one warm-up, the three taking turns. Writes a section of bench/RESULTS.md.

    python bench/bench_mla.py
    python bench/bench_mla.py --quick      # smoke test: s = 256
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Headline, add_common_args, command_line, publish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from activation_memory import count_saved  # noqa: E402
from cross_entropy_memory import LiveBytes  # noqa: E402
from megalite.config.schema import ModelConfig  # noqa: E402
from megalite.model.attention import build_attention  # noqa: E402
from megalite.model.attention.inputs import AttentionInputs  # noqa: E402
from megalite.model.attention.rotary import RotaryEmbedding  # noqa: E402
from megalite.parallel.tensor.layers import TensorParallel  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, GROUPS, BATCH = 1024, 16, 64, 4, 1
KV_RANK, NOPE, ROPE, V_DIM = 128, 64, 32, 64


def config(seq: int, **fields) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, kv_channels=HEAD_DIM,
                       ffn_hidden_size=4 * HIDDEN, seq_length=seq, max_position_embeddings=seq, padded_vocab_size=128,
                       position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False,
                       attention_dropout=0.0, hidden_dropout=0.0, norm_epsilon=1e-6, **fields)


def mla_config(seq: int) -> ModelConfig:
    """MLA whose q-LoRA rank makes its parameter count the GQA layer's."""
    gqa = HIDDEN * (HEADS + 2 * GROUPS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN
    rest = HIDDEN * (KV_RANK + ROPE) + KV_RANK + KV_RANK * HEADS * (NOPE + V_DIM) + HEADS * V_DIM * HIDDEN
    q_rank = round((gqa - rest) / (HIDDEN + 1 + HEADS * (NOPE + ROPE)))
    return config(seq, num_query_groups=HEADS, multi_latent_attention=True, q_lora_rank=q_rank, kv_lora_rank=KV_RANK,
                  qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V_DIM, qk_layernorm=True, rope_type="rope")


def transformers_twin(ours: torch.nn.Module, cfg: ModelConfig):
    """transformers' DeepseekV3Attention (sdpa) with ``ours``' weights, and its rotary embedding."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    hf_config = transformers.DeepseekV3Config(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
        max_position_embeddings=cfg.seq_length, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=False, attention_bias=False, attention_dropout=0.0, num_hidden_layers=1)
    hf_config._attn_implementation = "sdpa"
    hf = DeepseekV3Attention(hf_config, layer_idx=0)
    names = {"q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_layernorm", "q_b_proj": "linear_q_up_proj",
             "kv_a_proj_with_mqa": "linear_kv_down_proj", "kv_a_layernorm": "kv_layernorm",
             "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj"}
    with torch.no_grad():
        for hf_name, name in names.items():
            getattr(hf, hf_name).weight.copy_(ours.get_submodule(name).weight)
    return hf, DeepseekV3RotaryEmbedding(hf_config)


def measure(runs: dict, repeats: int) -> dict:
    """Saved bytes and forward peak of each run, then its fastest fwd+bwd: the runs take turns (one
    warm-up round, then ``repeats`` rounds), so load from other work on the machine falls on each alike."""
    results, times = {}, {name: [] for name in runs}
    for name, (run, _, module) in runs.items():
        with count_saved(module) as saved, LiveBytes() as live:
            out = run()
        del out
        results[name] = {"saved": saved.bytes(), "peak": live.peak,
                         "params": sum(p.numel() for p in module.parameters())}
    for _ in range(repeats + 1):
        for name, (run, grad, module) in runs.items():
            start = time.perf_counter()
            run().backward(grad)
            times[name].append(time.perf_counter() - start)
            module.zero_grad(set_to_none=True)
    for name, r in results.items():
        r["time"] = min(times[name][1:])
    return results


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    add_common_args(parser)
    args = parser.parse_args(argv)
    seq, repeats = (256, 1) if args.quick else (2048, args.repeats)
    torch.manual_seed(0)
    cfg_mla, cfg_gqa = mla_config(seq), config(seq, num_query_groups=GROUPS)
    modules = {name: build_attention(c, torch.float32, TensorParallel()) for name, c in
               (("mla", cfg_mla), ("gqa", cfg_gqa))}
    for module in modules.values():
        for p in module.parameters():
            torch.nn.init.normal_(p, 1.0 if p.dim() == 1 else 0.0, 0.02)
    hf, hf_rope = transformers_twin(modules["mla"], cfg_mla)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(seq, BATCH, HIDDEN, generator=g).requires_grad_()
    grad = torch.randn(seq, BATCH, HIDDEN, generator=g)
    x_hf = x.detach().transpose(0, 1).contiguous().requires_grad_()
    tables = {name: AttentionInputs(RotaryEmbedding(c.rotary_head_dim, c.rotary_base, seq).tables(None, seq, torch.float32))
              for name, c in (("mla", cfg_mla), ("gqa", cfg_gqa))}
    hf_tables = hf_rope(x_hf, torch.arange(seq)[None])
    runs = {"megalite MLA": (lambda: modules["mla"](x, tables["mla"]), grad, modules["mla"]),
            f"megalite GQA ({GROUPS} KV groups, equal parameters)": (lambda: modules["gqa"](x, tables["gqa"]), grad,
                                                                     modules["gqa"]),
            "transformers DeepseekV3Attention (sdpa), same weights": (
                lambda: hf(x_hf, hf_tables, None)[0], grad.transpose(0, 1), hf)}
    with torch.no_grad():
        torch.testing.assert_close(runs["transformers DeepseekV3Attention (sdpa), same weights"][0]().transpose(0, 1),
                                   runs["megalite MLA"][0](), rtol=1e-4, atol=1e-5)
    results = measure(runs, repeats)
    mla = results["megalite MLA"]
    body = [f"s = {seq}, batch {BATCH}, hidden {HIDDEN}, {HEADS} heads, fp32, causal, {torch.get_num_threads()} "
            f"threads. MLA: q-LoRA rank {cfg_mla.q_lora_rank}, KV latent {KV_RANK}, query/key {NOPE} + {ROPE} RoPE, "
            f"value {V_DIM}. GQA: head dim {HEAD_DIM}, {GROUPS} KV groups. The outputs of megalite's MLA and "
            "transformers' agree (checked).", "",
            "Per token MLA keeps its keys expanded to every head (heads x (64 + 32)) and its values zero-padded to "
            "that head dim for the fused kernel, where GQA keeps 4 groups' K and V: more bytes at equal "
            "parameters. transformers' SDPA call, with V's head dim unlike Q's, takes the math path on the CPU "
            "and keeps the s x s probabilities. Timings on a shared machine vary from run to run (see the load "
            "average above); the byte counts do not.", "",
            "| attention | parameters | fwd+bwd | MLA / it | saved for backward | MLA / it | forward peak | MLA / it |",
            "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        body.append(f"| {name} | {r['params'] / 1e6:.3f} M | {r['time'] * 1e3:.0f} ms | {mla['time'] / r['time']:.2f}x | "
                    f"{r['saved'] / 2**20:.1f} MiB | {mla['saved'] / r['saved']:.2f}x | "
                    f"{r['peak'] / 2**20:.1f} MiB | {mla['peak'] / r['peak']:.2f}x |")
        print(body[-1])
    command = command_line("bench_mla.py", argv)
    gqa, hf_r = (results[k] for k in list(results)[1:])
    headlines = [Headline("MLA fwd+bwd time", "GQA of equal parameters", f"{mla['time'] / gqa['time']:.2f}x", command),
                 Headline("MLA activation memory", "GQA of equal parameters",
                          f"{mla['saved'] / gqa['saved']:.2f}x saved, {mla['peak'] / gqa['peak']:.2f}x peak", command),
                 Headline("MLA fwd+bwd time", "transformers DeepseekV3Attention", f"{mla['time'] / hf_r['time']:.2f}x",
                          command),
                 Headline("MLA activation memory", "transformers DeepseekV3Attention",
                          f"{mla['saved'] / hf_r['saved']:.2f}x saved, {mla['peak'] / hf_r['peak']:.2f}x peak", command)]
    publish(args, "bench_mla", "Multi-latent attention vs GQA and transformers", command, headlines, body)


if __name__ == "__main__":
    main(sys.argv[1:])
