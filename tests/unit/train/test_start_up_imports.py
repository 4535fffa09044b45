"""What a rank imports before it trains. torch.compile's machinery (torch._dynamo) costs a second and about
70 MiB per process, which every rank and every data-loader worker forked from it would carry: only --compile
loads it (train/compile.py)."""
import subprocess
import sys

from megalite_test_utils import ROOT

CODE = ("import sys, pretrain_gpt, megalite.train.trainer, megalite.train.loop, megalite.train.step, "
        "megalite.optim.qk_clip; print('torch._dynamo' in sys.modules)")


def test_starting_a_rank_does_not_import_torch_compile():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr[-2000:]
