"""The CPU allocator policy pretrain_gpt.py sets for itself (megalite/train/allocator.py): in a bare
process (nothing preloaded, no malloc tunables) a freed 8 MiB block goes back to the OS, which glibc's
defaults keep in the heap; a policy the user set in the environment is left as it is."""
import json
import os
import subprocess
import sys

import pytest

from megalite_test_utils import ROOT
from megalite.train.allocator import user_chose_allocator

# The RSS an 8 MiB block leaves behind once freed. The first such block is mmap'd under any policy, and under
# glibc's defaults its free raises the mmap threshold, so the second comes from the heap and stays there.
KEPT = r"""
import ctypes, os
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
SIZE = 8 << 20

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def touched_then_freed():
    block = libc.malloc(SIZE)
    ctypes.memset(block, 1, SIZE)
    libc.free(block)

touched_then_freed()
before = rss()
touched_then_freed()
kept = rss() - before
"""
# pretrain_gpt.py's start-up, then KEPT in this process and in a child it starts (which inherits its environment)
PROBE = r"""
import json, os, runpy, subprocess, sys
sys.argv = ["pretrain_gpt.py", "--no-such-flag"]
try:
    runpy.run_path(os.path.join({root!r}, "pretrain_gpt.py"), run_name="__main__")
except SystemExit:
    pass
KEPT = {kept!r}
exec(KEPT)
child = subprocess.run([sys.executable, "-c", KEPT + "print(kept)"], capture_output=True, text=True, check=True)
print(json.dumps({{"kept": kept, "child_kept": int(child.stdout), "tunables": os.environ.get("GLIBC_TUNABLES")}}))
"""


def probe(**env) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=ROOT, kept=KEPT)], capture_output=True, text=True,
                         check=True, env={**base, "PYTHONPATH": ROOT, **env}).stdout
    return json.loads(out.splitlines()[-1])


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, read from /proc")


def test_the_bare_command_returns_a_freed_8_mib_block_to_the_os():
    bare = probe()
    assert bare["kept"] < 1 << 20, bare
    assert bare["child_kept"] < 1 << 20, bare                               # its children inherit the policy
    assert user_chose_allocator({"GLIBC_TUNABLES": bare["tunables"]})


def test_glibc_defaults_chosen_by_the_user_keep_it_and_the_policy_stays_off():
    """The control: the same probe tells the two apart (glibc.malloc.check=0 is glibc's default)."""
    chosen = probe(GLIBC_TUNABLES="glibc.malloc.check=0")
    assert chosen["kept"] >= 4 << 20 and chosen["child_kept"] >= 4 << 20, chosen
    assert chosen["tunables"] == "glibc.malloc.check=0"


@pytest.mark.parametrize("env, chose", [({}, False), ({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}, False),
                                        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}, True),
                                        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, True),
                                        ({"MALLOC_CONF": "background_thread:true"}, True)])
def test_an_allocator_in_the_environment_is_the_users_choice(env, chose):
    assert user_chose_allocator(env) is chose
