"""The MoE layer on one GPU: bf16 (the grouped GEMM kernel) and fp32 training equal the CPU run, and under
torchrun with NCCL (ZeRO-1: expert buckets over the expert-data-parallel group, dense ones over the
data-parallel group) each dispatcher equals the plain run (see test_cuda_tier.py for how runs are
launched)."""
import pytest

from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from test_cuda_tier import assert_close, losses, pretrain

pytestmark = pytest.mark.cuda

ARGV = with_flags(TINY_LLAMA_ARGS, train_iters=6, global_batch_size=8, lr_decay_style="constant", num_experts=8,
                  moe_router_topk=2, moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=64,
                  moe_aux_loss_coeff="1e-2", moe_z_loss_coeff="1e-3", moe_grouped_gemm=True)


def test_bf16_moe_on_the_gpu_equals_the_cpu_run():
    argv = with_flags(ARGV, bf16=True)
    gpu, cpu = losses(pretrain(argv)), losses(pretrain(argv, cpu=True))
    assert_close(gpu, cpu, rtol=2e-2)
    assert gpu[-1] < gpu[0]


def test_fp32_moe_on_the_gpu_equals_the_cpu_run():
    argv = with_flags(ARGV, no_tf32=True)
    assert_close(losses(pretrain(argv)), losses(pretrain(argv, cpu=True)), rtol=1e-4)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_nccl_world_size_one_equals_the_plain_run(dispatcher):
    argv = with_flags(ARGV, moe_token_dispatcher_type=dispatcher, use_distributed_optimizer=True)
    assert_close(losses(pretrain(argv, torchrun=True)), losses(pretrain(with_flags(ARGV, use_distributed_optimizer=True))),
                 rtol=1e-5)
