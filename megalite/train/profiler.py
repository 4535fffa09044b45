"""--profile: a profile of chosen iterations on chosen ranks (StepProfiler)."""
from __future__ import annotations

import os

import torch

from megalite.config.schema import TrainingConfig


class StepProfiler:
    """--profile: profile the iterations whose counter at their start is in [--profile-step-start,
    --profile-step-end) (Megatron's counting), on the ranks in --profile-ranks. On GPUs an nsys capture
    range (cudaProfilerStart/Stop) unless --use-pytorch-profiler; otherwise, and always on CPUs,
    torch.profiler, written as a Chrome trace into --tensorboard-dir (else --save, else ./profile)."""

    def __init__(self, t: TrainingConfig, rank: int, device: torch.device):
        self.t, self.rank = t, rank
        self.active = t.profile and rank in t.profile_ranks
        self.nsys = device.type == "cuda" and not t.use_pytorch_profiler
        self.nsys_running = False
        self.profiler = None

    def before_step(self, iteration: int) -> None:
        if not self.active or iteration != self.t.profile_step_start:
            return
        if self.nsys:
            torch.cuda.profiler.start()
            self.nsys_running = True
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profiler.start()

    def after_step(self, iteration: int) -> None:
        if self.active and iteration == self.t.profile_step_end:
            self.close()

    def close(self) -> None:
        """Stop what is running (also when training ends early) and write the trace."""
        if self.nsys_running:
            torch.cuda.profiler.stop()
            self.nsys_running = False
        if self.profiler is None:
            return
        self.profiler.stop()
        folder = self.t.tensorboard_dir or self.t.save or "profile"
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"profile_rank{self.rank}_iterations{self.t.profile_step_start + 1}-"
                                    f"{self.t.profile_step_end}.json")
        self.profiler.export_chrome_trace(path)
        self.profiler = None
        print(f" > profile of rank {self.rank} written to {path}", flush=True)
