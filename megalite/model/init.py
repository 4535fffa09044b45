"""Layout-independent weight initialisation that never draws a whole tensor.

Element k of the full (unsharded) tensor ``global_name`` gets a value that depends only on (run seed,
global name, k): a counter-based generator (an integer hash of the element's index, turned into a
normal sample by Box-Muller) instead of a sequential stream. A rank therefore computes exactly the
elements it holds, its tensor-parallel shard or only its ZeRO-3 chunk of it, and the same seed gives
bit-identical weights at any TP x PP x DP x CP x ZeRO layout without any rank building a full tensor
(what makes every parallel feature testable against the single-process run, and a model whose full
weights fit no single device startable).

The generator, for index k = hi * 2**32 + lo and a parameter's 32-bit key, with H a 32-bit mixer:
u(k, key) = (H(H(lo ^ H(hi ^ key)) ^ (key * 0x9E3779B1 mod 2**32)) + 0.5) / 2**32, and the value is
std * sqrt(-2 log u(k, key)) * cos(2 pi u(k, key ^ 0x5BD1E995)) in float64, rounded to float32.

How it is computed, on the device the values are asked for (the parameter's own; the CPU for a meta
parameter unless the caller names one), a few rows of the shard at a time: the hashes run in place on
int32 words (int32 products wrap modulo 2**32, keeping the low 32 bits the formula needs), the words of
both uniforms in one tensor, H(hi ^ key) one Python int per piece (hashed per element only in a piece that
straddles a multiple of 2**32); only Box-Muller runs in float64. On the CPU, pieces small enough for a
thread's temporaries to stay in cache are shared among threads, one per core of this process's share of
the machine (LOCAL_WORLD_SIZE ranks share it under torchrun), whatever torch's own thread count (torchrun
sets 1; it is 1 meanwhile, then restored). On CUDA, float64 log and cos need not round as the CPU's do in
the last bit, so a rare element may differ from the CPU's in its last float32 bit; layout independence
holds on each device type.
"""
from __future__ import annotations

import contextlib
import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import torch

from megalite.parallel.param_meta import param_meta
from megalite.parallel.tensor.layers import shard_positions

_MASK32 = 0xFFFFFFFF
_HASH_MULTIPLIER = 0x45D9F3B
_SECOND_KEY = 0x5BD1E995                # the key of the cosine's uniform is key ^ this
_KEY_MULTIPLIER = 0x9E3779B1
_CPU_PIECE = 1 << 17                    # elements a CPU thread draws at a time: 4 MiB of temporaries, in cache
_DEVICE_PIECE = 1 << 22                 # on an accelerator: fewer, larger kernels (128 MiB of temporaries)


def param_seed(seed: int, global_name: str) -> int:
    """A 32-bit key for one parameter of one run."""
    return (seed * 1_000_003 + zlib.crc32(global_name.encode())) & _MASK32


# ---- the generator ------------------------------------------------------------------------------
def _int32(word: int) -> int:
    """The int32 whose bits are the low 32 bits of ``word`` (int32 tensors carry the uint32 words)."""
    word &= _MASK32
    return word - (1 << 32) if word >> 31 else word


def _hash32(x: int) -> int:
    """The 32-bit integer mixer H on one word (a Python int < 2**32)."""
    for _ in range(3):
        x = (((x >> 16) ^ x) * _HASH_MULTIPLIER) & _MASK32
    return (x >> 16) ^ x


def _xorshift16_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """x ^= x >>> 16 in place: int32 shifts are arithmetic, so the shifted word is masked to 16 bits."""
    torch.bitwise_right_shift(x, 16, out=scratch)
    return x.bitwise_xor_(scratch.bitwise_and_(0xFFFF))


def _hash32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """H in place on an int32 tensor of words (``scratch``: one like it); int32 products wrap, keeping the
    low 32 bits of the unsigned product."""
    for _ in range(3):
        _xorshift16_(x, scratch).mul_(_HASH_MULTIPLIER)
    return _xorshift16_(x, scratch)


def _keys(key: int) -> tuple[int, int]:
    """The keys of the two uniforms: the radius's (log) and the angle's (cos)."""
    return key, key ^ _SECOND_KEY


class _Workspace:
    """One thread's temporaries for pieces of up to ``size`` elements: int32 words and float64 uniforms,
    row 0 for the radius (log) uniform, row 1 for the angle (cos) uniform."""

    def __init__(self, size: int, device: torch.device):
        self.words = torch.empty(2, size, dtype=torch.int32, device=device)
        self.scratch = torch.empty(2, size, dtype=torch.int32, device=device)
        self.uniform = torch.empty(2, size, dtype=torch.float64, device=device)
        # a 0-d float64 operand makes int32 + it a float64 sum (a Python float would make it float32)
        self.offset = torch.tensor(2.0 ** 31 + 0.5, dtype=torch.float64, device=device)
        self.scale = torch.tensor([[2.0 ** -32], [2.0 * math.pi * 2.0 ** -32]], dtype=torch.float64,
                                  device=device)
        self.device = device


def _box_muller(ws: _Workspace, n: int, std: float, out: torch.Tensor) -> None:
    """out (float32, n) <- std * sqrt(-2 log u0) * cos(2 pi u1) from the hashed words ws.words[:, :n].

    A word w with its top bit flipped is the int32 w - 2**31, so (that + 2**31 + 0.5) is w + 0.5, exactly,
    in int32 and float64 ops only. (w + 0.5) * 2**-32 is exact, and scaling by a power of two commutes with
    rounding, so folding 2 pi into the angle's scale gives the same double as 2 pi * u1."""
    u = ws.uniform[:, :n]
    torch.add(ws.words[:, :n].bitwise_xor_(-2 ** 31), ws.offset, out=u).mul_(ws.scale)
    radius, angle = u[0], u[1]
    radius.log_().mul_(-2.0).sqrt_().mul_(angle.cos_()).mul_(std)
    out.copy_(radius)                   # rounds to float32


# ---- the elements of a shard --------------------------------------------------------------------
class _Positions:
    """Where a shard's local elements sit in its full tensor: local (i, j) is full flat index
    ``base[i] + cols[j]`` (``base`` = full row * full_cols). int64 copies on the CPU give each piece's index
    range; their low words as int32 on the drawing device build the pieces' words."""

    def __init__(self, rows: torch.Tensor, cols: torch.Tensor, full_cols: int, device: torch.device):
        self.base, self.cols = rows.cpu() * full_cols, cols.cpu()
        self.base32 = self.base.to(torch.int32).to(device)      # int64 -> int32 keeps the low 32 bits
        self.cols32 = self.cols.to(torch.int32).to(device)

    def high_word(self, rows: slice, cols: slice) -> int | None:
        """The high 32 bits shared by every index of the rectangle, or None when they differ."""
        lo_b, hi_b = self.base[rows].aminmax()
        lo_c, hi_c = self.cols[cols].aminmax()
        first, last = (int(lo_b) + int(lo_c)) >> 32, (int(hi_b) + int(hi_c)) >> 32
        return first if first == last else None

    def high_words(self, rows: slice, cols: slice, device: torch.device) -> torch.Tensor:
        """The high 32 bits of each index of the rectangle (flat, row-major), as int32 on ``device``."""
        index = self.base[rows, None] + self.cols[None, cols]
        return (index >> 32).to(torch.int32).reshape(-1).to(device)


def _rectangles(start: int, end: int, local_cols: int, size: int) -> Iterator[tuple[int, slice, slice]]:
    """Local flat elements [start, end) of a [*, local_cols] shard as consecutive row-major rectangles of
    at most ``size`` elements: (first element, rows, cols), whole rows or a piece of one row."""
    k = start
    while k < end:
        row, col = divmod(k, local_cols)
        if col or end - k < local_cols or local_cols > size:      # a piece of one row
            n = min(local_cols - col, end - k, size)
            yield k, slice(row, row + 1), slice(col, col + n)
        else:
            rows = min((end - k) // local_cols, size // local_cols)
            n = rows * local_cols
            yield k, slice(row, row + rows), slice(0, local_cols)
        k += n


def _draw_piece(ws: _Workspace, pos: _Positions, rows: slice, cols: slice, key: int, std: float,
                out: torch.Tensor) -> None:
    """out (float32) <- the values of one rectangle of local elements: both uniforms' words hashed at once."""
    n = out.numel()
    words, scratch = ws.words[:, :n], ws.scratch[:, :n]
    shape = (2, rows.stop - rows.start, cols.stop - cols.start)
    torch.add(pos.base32[rows, None].expand(shape), pos.cols32[cols], out=words.view(shape))   # lo
    high = pos.high_word(rows, cols)
    if high is None:            # the rectangle straddles a multiple of 2**32: H(hi ^ key) per element
        high_words = pos.high_words(rows, cols, ws.device)
        keyed = torch.stack([high_words ^ _int32(k) for k in _keys(key)])
        words.bitwise_xor_(_hash32_(keyed, torch.empty_like(keyed)))
    else:
        for row, k in zip(words, _keys(key)):
            row.bitwise_xor_(_int32(_hash32(high ^ k)))
    _hash32_(words, scratch)
    for row, k in zip(words, _keys(key)):
        row.bitwise_xor_(_int32(k * _KEY_MULTIPLIER))
    _hash32_(words, scratch)
    _box_muller(ws, n, std, out)


def _threads() -> int:
    """CPU threads for drawing: this process's cores, shared with the other ranks torchrun started on
    the node (LOCAL_WORLD_SIZE), at least one."""
    linux = hasattr(os, "sched_getaffinity")      # probe: Linux only; it counts the cores this process may use
    cores = len(os.sched_getaffinity(0)) if linux else (os.cpu_count() or 1)
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


@contextlib.contextmanager
def _single_threaded_ops() -> Iterator[None]:
    """torch ops without intra-op threads for the duration (threads created meanwhile inherit it)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _draw(pos: _Positions, start: int, end: int, key: int, std: float, out: torch.Tensor) -> None:
    """out (float32, end - start, on the drawing device) <- the values of local elements [start, end)."""
    size = _CPU_PIECE if out.device.type == "cpu" else _DEVICE_PIECE
    pieces = list(_rectangles(start, end, pos.cols.numel(), size))
    workers = min(len(pieces), _threads()) if out.device.type == "cpu" else 1

    def draw(share: list) -> None:
        ws = _Workspace(min(size, end - start), out.device)
        for first, rows, cols in share:
            n = (rows.stop - rows.start) * (cols.stop - cols.start)
            _draw_piece(ws, pos, rows, cols, key, std, out[first - start:first - start + n])

    if workers <= 1:
        draw(pieces)
        return
    with _single_threaded_ops(), ThreadPoolExecutor(workers) as pool:     # torch ops release the GIL
        for done in [pool.submit(draw, pieces[i::workers]) for i in range(workers)]:
            done.result()


# ---- parameters ---------------------------------------------------------------------------------
def full_normal(global_name: str, full_shape, std: float, seed: int) -> torch.Tensor:
    """The whole fp32 tensor N(0, std) a parameter name gets for this seed (tests and small tools only)."""
    n = math.prod(full_shape)
    out = torch.empty(n)
    _draw(_Positions(torch.arange(n), torch.arange(1), 1, out.device), 0, n, param_seed(seed, global_name),
          std, out)
    return out.view(full_shape)


def init_std(global_name: str, base_std: float, num_layers: int) -> float:
    """Megatron's scheme: output projections of each block are scaled by 1/sqrt(2 * num_layers)."""
    if global_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return base_std / math.sqrt(2.0 * num_layers)
    return base_std


def initial_values(param: torch.nn.Parameter, global_name: str, base_std: float, num_layers: int, seed: int,
                   start: int, end: int, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 initial values of this rank's elements [start, end) of ``param`` (flat, local to its TP shard):
    norms -> 1, biases -> 0, weights -> N(0, std) at their positions in the full tensor. Drawn on
    ``device``: by default the parameter's own, the CPU for a storage-less (meta) parameter.

    A sharded parameter's record carries ``full_shape``, ``partition_dim`` and ``take_shard`` (set by the
    tensor-parallel layers; see ``shard_positions``); an unsharded one is its own full tensor."""
    if device is None:
        device = "cpu" if param.device.type == "meta" else param.device
    meta = param_meta(param)
    if meta.is_norm_weight:      # 1, or 0 for --apply-layernorm-1p's zero-centred weights
        return torch.full((end - start,), float(meta.norm_init_value), device=device)
    if global_name.endswith(".bias"):
        return torch.zeros(end - start, device=device)
    out = torch.empty(end - start, device=device)
    if end > start:
        rows, cols, full_cols = shard_positions(param)
        key, std = param_seed(seed, global_name), init_std(global_name, base_std, num_layers)
        _draw(_Positions(rows, cols, full_cols, out.device), start, end, key, std, out)
    return out


@torch.no_grad()
def initialize_parameter(param: torch.nn.Parameter, global_name: str, base_std: float, num_layers: int,
                         seed: int) -> None:
    """Fill a materialised ``param`` in place with its initial values, drawn on its device."""
    values = initial_values(param, global_name, base_std, num_layers, seed, 0, param.numel())
    param.copy_(values.view(param.shape))
