"""The launch environment on GPU clusters, without a GPU: which GPU a rank takes (one visible GPU per task,
LOCAL_RANK into the visible ones, or a one-line error), which ranks SLURM's variables describe (an srun
task; the batch step of an sbatch script and a salloc shell run one process), torchrun over SLURM, and
``device_id`` for NCCL's eager start (not for gloo)."""
import pytest
import torch

from megalite.parallel import initialize
from megalite.train.command_line import world_size_from_env
from megalite.config.schema import ParallelConfig
from megalite.errors import UserError
from megalite.parallel.initialize import device_for, initialize_distributed
from megalite.parallel.launch_env import LaunchEnv, read_launch_env, restart_note, single_process_note

JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_NTASKS": "8", "SLURM_NPROCS": "8",
       "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": "2"}
# what srun gives task 5 of an 8-task step (4 tasks per node)
SRUN_TASK = {**JOB, "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0",
             "SLURM_STEPID": "0", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2",
             "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
# the batch step running an sbatch script: the job's task count, task 0 of it, no step variables
BATCH_STEP = {**JOB, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_TASK_PID": "123",
              "SLURM_GTIDS": "0", "ENVIRONMENT": "BATCH"}
# salloc with an interactive step: srun's step variables, with Slurm's reserved interactive step id
INTERACTIVE_STEP = {**JOB, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "4294967290",
                    "SLURM_STEPID": "4294967290", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"}
SALLOC_SHELL = dict(JOB)                       # on the login node: no task variables at all
TORCHRUN_UNDER_SRUN = {**SRUN_TASK, "RANK": "13", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "MASTER_ADDR": "n1"}


def fake_gpus(monkeypatch, count: int) -> list:
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


# ---- which GPU -------------------------------------------------------------------------------------
def test_one_visible_gpu_per_task_is_cuda_0_whatever_the_local_rank(monkeypatch):
    chosen = fake_gpus(monkeypatch, 1)
    assert device_for(5) == torch.device("cuda", 0) and chosen == [0]


def test_all_of_the_nodes_gpus_visible_the_local_rank_picks_one(monkeypatch):
    chosen = fake_gpus(monkeypatch, 8)
    assert device_for(5) == torch.device("cuda", 5) and chosen == [5]


@pytest.mark.parametrize("local_rank", [2, 3])
def test_more_local_ranks_than_visible_gpus_is_a_one_line_error(monkeypatch, local_rank):
    chosen = fake_gpus(monkeypatch, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(UserError) as error:
        device_for(local_rank)
    message = str(error.value)
    assert "\n" not in message and chosen == []
    assert f"LOCAL_RANK {local_rank}" in message and "sees 2 GPUs (CUDA_VISIBLE_DEVICES=0,1)" in message
    assert "torchrun --nproc_per_node 2" in message and "srun --gpus-per-task=1" in message
    assert error.value.local                   # each rank reports its own


# ---- which ranks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("env, expected", [
    (SRUN_TASK, (5, 8, 1, "gpu07", True)),
    # srun --preserve-env -n 2 in an 8-task job: the step's 2 tasks, not the job's 8
    ({**SRUN_TASK, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}, (1, 2, 1, "gpu07", True)),
    (BATCH_STEP, (0, 1, 0, "127.0.0.1", False)),
    (INTERACTIVE_STEP, (0, 1, 0, "127.0.0.1", False)),
    (SALLOC_SHELL, (0, 1, 0, "127.0.0.1", False)),
    (TORCHRUN_UNDER_SRUN, (13, 16, 5, "n1", True)),
    # SLURM_PROCID/SLURM_NTASKS without an allocation (a launcher of its own): taken as they are
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5"}, (5, 16, 5, "127.0.0.1", True)),
    ({}, (0, 1, 0, "127.0.0.1", False)),
], ids=["srun-task", "srun-step-smaller-than-job", "sbatch-batch-step", "salloc-interactive-step",
        "salloc-shell", "torchrun-wins", "slurm-variables-without-a-job", "plain"])
def test_launch_env(env, expected):
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master_addr, launch.launched) == expected
    assert world_size_from_env(env) == launch.world_size        # the flags are checked for the same world


def test_a_bad_step_task_count_is_a_one_line_error():
    with pytest.raises(UserError, match="SLURM_STEP_NUM_TASKS='x' must be an integer >= 1"):
        read_launch_env({**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "x"})


def test_only_a_process_alone_in_a_multi_task_allocation_says_so():
    note = single_process_note(BATCH_STEP)
    assert "\n" not in note and "SLURM_NTASKS=8" in note and "running as one process" in note
    assert "srun python pretrain_gpt.py" in note
    for env in (SRUN_TASK, TORCHRUN_UNDER_SRUN, INTERACTIVE_STEP, {**BATCH_STEP, "SLURM_NTASKS": "1"}, {}):
        assert single_process_note(env) is None


def test_torchrun_restarts_that_would_hang_are_named_in_one_line():
    shared = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    note = restart_note(shared)
    assert "\n" not in note and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in note and "--max-restarts 3" in note
    for env in ({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}, {**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}, {}):
        assert restart_note(env) is None


# ---- starting torch.distributed --------------------------------------------------------------------
@pytest.fixture
def started(monkeypatch):
    """initialize_distributed with init_process_group and the rank grid recorded instead of run."""
    calls = []
    monkeypatch.setattr(initialize.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(initialize.dist, "init_process_group", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(initialize.ParallelState, "build", staticmethod(lambda *args, **kwargs: "grid"))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    return calls


def test_nccl_gets_the_device_for_its_eager_start(monkeypatch, started):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(initialize, "device_for", lambda local_rank: cuda)
    assert initialize_distributed(ParallelConfig(), env=LaunchEnv(1, 2, 0, launched=True)) == ("grid", cuda)
    (args, kwargs), = started
    assert args == ("nccl",) and kwargs["device_id"] == cuda and (kwargs["rank"], kwargs["world_size"]) == (1, 2)


def test_gloo_gets_no_device(monkeypatch, started):
    monkeypatch.setattr(initialize, "device_for", lambda local_rank: torch.device("cpu"))
    initialize_distributed(ParallelConfig(), env=LaunchEnv(1, 2, 0, launched=True))
    (args, kwargs), = started
    assert args == ("gloo",) and "device_id" not in kwargs


def test_torch_2_7_0_starts_nccl_eagerly_without_its_hanging_non_blocking_mode(monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_USE_COMM_NONBLOCKING", "")
    monkeypatch.delenv("TORCH_NCCL_USE_COMM_NONBLOCKING")       # restored as it was after the test
    monkeypatch.setattr(torch, "__version__", "2.7.0+cu126")
    assert initialize.process_group_options(torch.device("cuda", 0)) == {"device_id": torch.device("cuda", 0)}
    assert initialize.os.environ["TORCH_NCCL_USE_COMM_NONBLOCKING"] == "0"


def test_a_batch_step_runs_one_process_and_says_so_once(monkeypatch, started, capsys):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in BATCH_STEP.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(initialize, "device_for", lambda local_rank: torch.device("cpu"))
    initialize_distributed(ParallelConfig())
    assert started == []                                        # no process group, no peers awaited
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "SLURM_NTASKS=8" in lines[0]
