"""PipeDream and PipeDream-2BW (asynchronous, weight stashing) against a single-process reference that
applies the same delayed updates, through megalite's real optimizer (MixedPrecisionOptimizer with weight
decay, clipping at a global norm, a warm-up + cosine LR schedule), under the NCCL-semantics tier; exact
resume; refusals."""
import pytest
import torch

from harness import run_ranks
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.errors import UserError
from megalite.config.validate import check_async_schedule
from megalite.parallel.pipeline.pipedream import AsyncPipeline, WeightVersions

ITERS = 6
ARGS = with_flags(TINY_LLAMA_ARGS, num_layers=4, train_iters=ITERS, global_batch_size=8,
                  make_vocab_size_divisible_by=32, lr_warmup_iters=2, lr_decay_style="cosine", clip_grad=0.5,
                  weight_decay=0.1, lr=3e-3)


def reference_version(schedule: str, pp: int, stage: int, m: int, j: int) -> int:
    """The rule of the module docstring, restated: the weight version micro-batch j uses on ``stage``."""
    if schedule == "pipedream":
        return max(0, (j - (pp - 1 - stage)) // m)
    return max(0, j // m - 1)


def stage_of(name: str, num_layers: int, pp: int) -> int:
    """Pipeline stage holding parameter ``name`` with an even split (embedding first, head last)."""
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2]) // (num_layers // pp)
    return 0 if name.startswith("embedding.") else pp - 1


def reference_history(argv: list[str], schedule: str, pp: int, dp: int = 1) -> list[float]:
    """One process, synchronous step code; before each micro-batch's forward every parameter is set to the
    version its stage would use (the backward follows at once, on the same values), and the optimizer
    steps the newest version: W(t+1) = W(t) - AdamW(G(t)), G(t) from the versions above. With data
    parallelism the pipelined run's micro-batch count per rank is m / dp, and the reference's i-th
    micro-batch of a step is micro-batch i // dp of a data-parallel rank (the sampler deals consecutive
    micro-batches to consecutive ranks)."""
    from megalite.data.tokenizers import build_tokenizer
    from megalite.train.trainer import build_data_iterators, build_trainer
    from megalite.train.step import train_step
    config = parse_args(with_flags(argv, pipeline_model_parallel_size=None, tensor_model_parallel_size=None,
                                   pipeline_schedule=None), world_size=1)
    trainer = build_trainer(config)
    train_iter = build_data_iterators(trainer, build_tokenizer(config.data))[0]
    flat, m = trainer.buffer.param_data, config.num_microbatches // dp
    masks = [torch.zeros(flat.numel(), dtype=torch.bool) for _ in range(pp)]
    for name, slot in trainer.buffer.slots.items():
        masks[stage_of(name, config.model.num_layers, pp)][slot.start:slot.end] = True
    history, micro = [flat.clone()], [0]

    def set_versions(module, args):
        with torch.no_grad():
            for stage, mask in enumerate(masks):
                step, i = divmod(micro[0], m * dp)
                flat[mask] = history[reference_version(schedule, pp, stage, m, step * m + i // dp)][mask]
        micro[0] += 1

    trainer.model.register_forward_pre_hook(set_versions)
    step = trainer.optimizer.step

    def delayed_step(*args):
        with torch.no_grad():
            flat.copy_(history[-1])
        result = step(*args)
        history.append(flat.clone())
        return result

    trainer.optimizer.step = delayed_step
    return [float(train_step(trainer, train_iter)[0]) for _ in range(config.training.train_iters)]


def _histories(rank, world, runs):
    from megalite.train.trainer import pretrain
    return [pretrain(parse_args(argv, world_size=world), print_fn=lambda *_: None).history for argv in runs]


def _runs(tmp, world, layouts):
    """Each layout plain, and for the first of each schedule: saved at iteration 3 and resumed."""
    runs, resumed = [], []
    for i, (schedule, layout) in enumerate(layouts):
        resume = layout.pop("resume", False)
        argv = with_flags(ARGS, pipeline_schedule=schedule, **layout)
        runs.append(argv)
        if resume:
            save = f"{tmp}/ckpt{world}_{i}"
            runs += [with_flags(argv, save=save, exit_interval=3), with_flags(argv, load=save, save=save)]
            resumed.append(len(runs) - 1)
    return runs, resumed


def check_against_reference(tmp, world, layouts):
    runs, resumed = _runs(tmp, world, layouts)
    last_rank = run_ranks(world, _histories, runs, nccl=True)[-1]   # the last stage logs the loss; NCCL's rules
    contrasted = set()
    for i, (argv, history) in enumerate(zip(runs, last_rank)):
        if "--load" in argv:
            assert history == pytest.approx(last_rank[i - 2][3:], rel=1e-6, abs=1e-6), ("resume", argv)
            continue
        if "--save" in argv:
            continue
        schedule = argv[argv.index("--pipeline-schedule") + 1]
        pp = int(argv[argv.index("--pipeline-model-parallel-size") + 1])
        tp = int(argv[argv.index("--tensor-model-parallel-size") + 1]) if "--tensor-model-parallel-size" in argv else 1
        ref = reference_history(argv, schedule, pp, world // (pp * tp))
        assert len(history) == ITERS
        assert history == pytest.approx(ref, rel=1e-5), argv
        if pp not in contrasted:                   # the delays matter: synchronous training differs
            contrasted.add(pp)
            assert ref[2:] != pytest.approx(reference_history(argv, "pipedream", 1)[2:], rel=1e-4)
    assert resumed


def test_pipedream_and_2bw_equal_their_delayed_reference_pp2(tmp_path):
    check_against_reference(tmp_path, 2, [
        ("pipedream", {"pipeline_model_parallel_size": 2, "global_batch_size": 2, "resume": True}),   # m = 1
        ("pipedream-2bw", {"pipeline_model_parallel_size": 2, "untie_embeddings_and_output_weights": False}),
    ])


@pytest.mark.slow
def test_async_schedules_pp4_and_with_tp_dp(tmp_path):
    check_against_reference(tmp_path, 4, [
        ("pipedream", {"pipeline_model_parallel_size": 4, "global_batch_size": 4, "resume": True}),   # m = 2
        ("pipedream-2bw", {"pipeline_model_parallel_size": 4, "untie_embeddings_and_output_weights": False,
                           "resume": True}),
        ("pipedream", {"pipeline_model_parallel_size": 4}),                                            # m = 4
        ("pipedream", {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2,
                       "sequence_parallel": True}),
        ("pipedream-2bw", {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2,
                           "sequence_parallel": True}),
        ("pipedream-2bw", {"pipeline_model_parallel_size": 2}),                                      # DP 2
        ("pipedream", {"pipeline_model_parallel_size": 2, "use_distributed_optimizer": True, "resume": True}),
        ("pipedream-2bw", {"pipeline_model_parallel_size": 2, "data_parallel_sharding_strategy": "optim_grads"}),
    ])


class _LoopbackComm:
    """Stands in for the neighbours: every receive returns a fresh one-element tensor, sends vanish."""

    def global_rank(self, pipeline_rank):
        return pipeline_rank

    def send(self, tensor, dst):
        pass

    def post_recv(self, src):
        return torch.ones(1)

    def wait(self, received):
        return received

    def flush(self):
        pass


def test_versions_kept_per_stage():
    """The memory the docstring states: pipedream keeps 1 + ceil(w/m) versions on a stage with w warm-up
    forwards, 2BW keeps 2; the bookkeeping run over a stream of 10 steps without a model."""
    for schedule, pp, m in [("pipedream", 4, 1), ("pipedream", 4, 2), ("pipedream-2bw", 4, 3),
                            ("pipedream-2bw", 2, 4)]:
        for stage in range(pp):
            weight = torch.ones(1, requires_grad=True)
            forward = lambda chunk, x, batch, last: (x if x is not None else weight) * 2.0     # noqa: E731
            runner = AsyncPipeline(schedule, torch.zeros(3), _LoopbackComm(), pp, stage, m, 10, forward)
            peak, before = [0], runner.before

            def counted(action, before=before, runner=runner):
                if action.kind == "B":
                    peak[0] = max(peak[0], runner.versions.count())
                before(action)

            def update(runner=runner):
                runner.versions.flat.add_(1.0)             # the "update"
                peak[0] = max(peak[0], runner.versions.count())

            runner.before = counted
            for t in range(10):
                runner.forward_backward(t, lambda: [{}] * m)
                runner.optimizer_step(t, update)
            w = pp - 1 - stage
            expected = 1 + -(-w // m) if schedule == "pipedream" else 2
            assert peak[0] == expected, (schedule, pp, m, stage)
            # every version was the right one: version k of the flat buffer holds k everywhere
            assert runner.versions.flat.tolist() == [10.0] * 3


def test_weight_versions_swap_in_place():
    flat = torch.tensor([1.0, 2.0])
    versions = WeightVersions(flat)
    versions.before_update(keep_newest=True)
    flat.add_(10.0)
    versions.after_update(oldest_needed=0)
    versions.use(0)
    assert flat.tolist() == [1.0, 2.0] and versions.stash[1].tolist() == [11.0, 12.0]
    versions.use(1)
    versions.drop_older_than(1)
    assert flat.tolist() == [11.0, 12.0] and versions.count() == 1


@pytest.mark.parametrize("flags, message", [
    ({"context_parallel_size": 2}, "--context-parallel-size"),
    ({"num_layers_per_virtual_pipeline_stage": 1}, "one model chunk per rank"),
    ({"data_parallel_sharding_strategy": "optim_grads_params"}, "ZeRO-3"),
    ({"use_distributed_optimizer": True, "overlap_param_gather": True}, "--overlap-param-gather"),
    ({"rampup_batch_size": ["4", "4", "16"]}, "--rampup-batch-size"),
])
def test_unsupported_combinations_are_refused_in_one_line(flags, message):
    rampup = flags.pop("rampup_batch_size", [])
    argv = with_flags(ARGS, pipeline_schedule="pipedream", pipeline_model_parallel_size=2, **flags)
    argv += ["--rampup-batch-size", *rampup] if rampup else []
    config = parse_args(argv, world_size=2 * flags.get("context_parallel_size", 1))
    with pytest.raises(UserError) as err:
        check_async_schedule(config)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_2bw_needs_enough_microbatches():
    config = parse_args(with_flags(ARGS, pipeline_schedule="pipedream-2bw", pipeline_model_parallel_size=4,
                                   global_batch_size=4), world_size=4)      # m = 2 < pp - 1 = 3
    with pytest.raises(UserError, match="at least pipeline size - 1 = 3 micro-batches"):
        check_async_schedule(config)
