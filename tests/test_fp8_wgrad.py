"""The FP8 weight gradient (moe_ep.moe.fp8_wgrad, K-grouped) against float64 oracles written here from the layout's
definition: quantize_k_grouped's torch version (placement, zero padding, scales bit for bit against tests/oracle.py's
FP8 definition, every value within one e4m3 step of x / scale) and weight_grad's torch path (dequantized operands,
one matmul per group, float64) with groups of 0, 1, 127, 128, 129 and 300 tokens, clipped counts and no tokens at
all. On the CPU the Triton quantizer runs in Triton's interpreter (a subprocess with TRITON_INTERPRET=1, its e4m3
values written as float32, since the interpreter's e4m3 rounding is loose): placement and scales bit for bit
against the torch version. On a GPU: the Triton quantizer against the torch version bit for bit, the CUTLASS
K-grouped GEMM (moe_ep.moe.fp8_grouped_gemm_sm90.wgrad_gemm) on NaN-poisoned outputs against the float64 oracle
(empty groups exactly 0, the same bits on a second run), at the bench's size too, and no host sync."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from moe_ep.moe import fp8_grouped_gemm_sm90 as sm90
from moe_ep.moe import fp8_wgrad as fw
from tests._interpret import run_interpreted
from tests.oracle import e4m3_bits, fp8_scales

E4M3_MAX = 448.0


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


@dataclass(frozen=True)
class Case:
    """One operand pair: `counts` per group (may be negative or pass `tokens`), `tokens` rows (default
    sum(counts)), dy [tokens, m], x [tokens, n]."""

    counts: tuple[int, ...]
    m: int
    n: int
    tokens: Optional[int] = None

    @property
    def rows(self) -> int:
        return sum(max(c, 0) for c in self.counts) if self.tokens is None else self.tokens


CPU_CASES = [
    Case((0, 1, 127, 128, 129, 300), 192, 136),  # every size of the brief, an empty group first
    Case((300, 0, 1, 129, 0, 127, 128, 0), 200, 64),  # empty groups between and last; 200 channels: a partial tile
    Case((40, 90), 128, 128, tokens=100),  # counts past the rows: the second group keeps 60
    Case((5, -3, 17), 64, 72),  # a negative count counts as 0
    Case((0, 0, 0), 64, 64),  # no tokens at all: every output 0
]


def _inputs(case: Case, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy [P, M] and x [P, N] bf16 with channels of very different magnitudes (one all zero: the amax floor), from a
    fresh seed (printed: pytest shows it with a failure)."""
    seed = random.randrange(1 << 30)
    print(f"{case}: seed {seed}")
    g = torch.Generator().manual_seed(seed)
    p = case.rows
    dy = torch.randn(p, case.m, generator=g) * torch.rand(1, case.m, generator=g) * 4
    x = torch.randn(p, case.n, generator=g) * torch.rand(1, case.n, generator=g) * 0.5
    dy[:, 1] = 0
    return (dy.to(torch.bfloat16).to(device), x.to(torch.bfloat16).to(device),
            torch.tensor(case.counts, dtype=torch.int32, device=device))


# ---- oracles ---------------------------------------------------------------------------------------
def _placement(counts: list[int], tokens: int) -> list[tuple[int, int, int, int]]:
    """(first row, tokens, first column, first scale block) of each group, from the layout's definition."""
    out, row, column, block = [], 0, 0, 0
    for raw in counts:
        raw = max(raw, 0)
        start = min(row, tokens)
        n = min(raw, tokens - start)
        out.append((start, n, column, block))
        row, column, block = row + raw, column + _round_up(n, 16), block + -(-n // 128)
    return out


def _check_quantized(t: torch.Tensor, counts: list[int], q_t: torch.Tensor, scales: torch.Tensor, what: str) -> None:
    """q_t, scales (on the CPU) against the K-grouped layout of t: shapes, placement, zeros everywhere else, scales
    bit for bit against tests/oracle.py's rule, values bit for bit against its e4m3 rounding and within one e4m3
    step of float64 x / scale."""
    p, c = t.shape
    e = len(counts)
    assert q_t.dtype == torch.float8_e4m3fn and q_t.shape == (c, _round_up(p + 15 * e, 16)), f"{what}: q_t shape"
    assert scales.dtype == torch.float32 and scales.shape == (c * (p // 128 + e + 1),), f"{what}: scales shape"
    column_used = torch.zeros(q_t.shape[1], dtype=torch.bool)
    blocks_used = 0
    for start, n, column, block in _placement(counts, p):
        kb = -(-n // 128)
        column_used[column:column + _round_up(n, 16)] = True
        blocks_used = block + kb
        if n == 0:
            continue
        x = t[start:start + n].t().float()  # [C, n], exact (bf16 in float32)
        token_block = torch.arange(n) // 128
        got_scale = scales[c * block:c * (block + kb)].view(c, kb)
        amax = torch.nn.functional.pad(x.abs(), (0, kb * 128 - n)).view(c, kb, 128).amax(-1)
        want_scale = fp8_scales(amax)
        assert torch.equal(got_scale.view(torch.int32), want_scale.view(torch.int32)), f"{what}: scales"
        ideal = x.double() / got_scale.double()[:, token_block]
        got = q_t[:, column:column + n]
        want_bits = e4m3_bits((x.double() / got_scale.double()[:, token_block]).float())
        assert torch.equal(got.view(torch.uint8), want_bits), f"{what}: values (bits)"
        _, exp = torch.frexp(ideal.abs())
        step = torch.ldexp(torch.ones_like(ideal), torch.clamp(exp - 1, min=-6) - 3)
        assert bool(((got.double() - ideal).abs() <= step).all()), f"{what}: a value off by more than one e4m3 step"
        assert bool((ideal.abs() <= E4M3_MAX * (1 + 2 ** -20)).all()), f"{what}: x / scale past 448"
        padding = q_t[:, column + n:column + _round_up(n, 16)]
        assert not bool(padding.view(torch.uint8).any()), f"{what}: a group's 16-alignment padding is not 0"
    assert not bool(q_t[:, ~column_used].view(torch.uint8).any()), f"{what}: a column no group owns is not 0"
    assert not bool(scales[c * blocks_used:].view(torch.int32).any()), f"{what}: a scale past the last block is not 0"


def _groups_f64(q_t: torch.Tensor, scales: torch.Tensor, counts: list[int], tokens: int) -> list[torch.Tensor]:
    """Each group's dequantized operand [C, n_e] in float64 (on q_t's device), from the layout's definition."""
    c = q_t.shape[0]
    out = []
    for _, n, column, block in _placement(counts, tokens):
        kb = -(-n // 128)
        s = scales[c * block:c * (block + kb)].double().view(c, kb)
        out.append(q_t[:, column:column + n].double() * s[:, torch.arange(n, device=q_t.device) // 128])
    return out


def _wgrad_f64(q_dy, s_dy, q_x, s_x, counts: list[int], tokens: int) -> torch.Tensor:
    """float64 [E, M, N]: group e's dequantized dy^T times its dequantized x (zeros for an empty group)."""
    return torch.stack([a @ b.t() for a, b in zip(_groups_f64(q_dy, s_dy, counts, tokens),
                                                   _groups_f64(q_x, s_x, counts, tokens))])


def _within(got: torch.Tensor, want: torch.Tensor, what: str, steps: float = 1.0) -> None:
    """got (bf16) against float64 want: no NaN (poison), exact zeros where want is an empty group's 0, and within
    `steps` bf16 roundings (2^-8 relative each) of the largest value."""
    got = got.double()
    assert not bool(torch.isnan(got).any()), f"{what}: elements left unwritten (NaN poison)"
    err = (got - want).abs().max().item() if want.numel() else 0.0
    bound = steps * 2 ** -8 * want.abs().max().item() + 1e-30 if want.numel() else 0.0
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e}"


def _empty_groups_zero(out: torch.Tensor, counts: list[int], tokens: int, what: str) -> None:
    for e, (_, n, _, _) in enumerate(_placement(counts, tokens)):
        if n == 0:
            assert not bool(out[e].view(torch.int16).any()), f"{what}: empty group {e} is not exactly 0"


# ---- CPU: the torch versions -----------------------------------------------------------------------
@pytest.mark.parametrize("index", range(len(CPU_CASES)))
def test_quantize_torch_matches_oracle(index: int) -> None:
    """quantize_k_grouped (the torch version on the CPU) of both operands against the layout's definition."""
    case = CPU_CASES[index]
    dy, x, counts = _inputs(case)
    for t in (dy, x):
        q_t, scales = fw.quantize_k_grouped(t, counts)
        _check_quantized(t, list(case.counts), q_t, scales, f"{case}")
        q2, s2 = fw.quantize_k_grouped_torch(t, counts.long())  # int64 counts: the same bits
        assert torch.equal(q2.view(torch.uint8), q_t.view(torch.uint8)) and torch.equal(s2, scales)


def test_layout_bounds_hold() -> None:
    """k_grouped_layout agrees with the definition and stays inside the static bounds for random counts."""
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        e = int(torch.randint(1, 40, (1,), generator=g))
        counts = torch.randint(-2, 300, (e,), generator=g) * (torch.rand(e, generator=g) > 0.3)
        tokens = int(counts.clamp_min(0).sum()) + int(torch.randint(-50, 3000, (1,), generator=g))
        tokens = max(tokens, 0)
        layout = fw.k_grouped_layout(counts, tokens)
        want = _placement(counts.tolist(), tokens)
        assert list(zip(layout.starts, layout.counts, layout.columns, layout.blocks)) == want
        last_start, last_n, last_column, last_block = want[-1]
        assert last_column + _round_up(last_n, 16) <= fw.k_grouped_columns(tokens, e)
        total_blocks = last_block + -(-last_n // 128)
        assert total_blocks < fw.k_grouped_scale_blocks(tokens, e)  # one block to spare
        assert sum(layout.counts) <= tokens
        tail = fw.k_grouped_columns(tokens, e) - last_column - _round_up(last_n, 16)
        idle = fw.k_grouped_scale_blocks(tokens, e) - total_blocks
        assert idle * fw._TAIL >= tail, "the Triton quantizer's idle programs do not cover the tail columns"


@pytest.mark.parametrize("index", range(len(CPU_CASES)))
def test_weight_grad_torch_path_matches_oracle(index: int) -> None:
    """weight_grad on the CPU (the torch path) against the float64 oracle over the same quantized operands, within
    one bf16 rounding of each value (plus float32 sums); empty groups exactly 0; near the unquantized dy^T x."""
    case = CPU_CASES[index]
    dy, x, counts = _inputs(case)
    got = fw.weight_grad(dy, x, counts)
    assert got.dtype == torch.bfloat16 and got.shape == (len(case.counts), case.m, case.n)
    q_dy, s_dy = fw.quantize_k_grouped_torch(dy, counts)
    q_x, s_x = fw.quantize_k_grouped_torch(x, counts)
    want = _wgrad_f64(q_dy, s_dy, q_x, s_x, list(case.counts), case.rows)
    err = (got.double() - want).abs()
    assert bool((err <= 2 ** -8 * want.abs() + 1e-5 * want.abs().max()).all()), f"{case}: max error {err.max():.3e}"
    _empty_groups_zero(got, list(case.counts), case.rows, f"{case}")
    exact, bound = _unquantized_product_and_bound(dy, x, list(case.counts), case.rows)
    far = (got.double() - exact).abs() > bound + 2 ** -8 * exact.abs()
    assert not bool(far.any()), f"{case}: {int(far.sum())} values farther from the unquantized dy^T x than FP8 allows"
    out = torch.full_like(got, float("nan"))
    assert fw.weight_grad(dy, x, counts, out=out) is out and torch.equal(out.view(torch.int16), got.view(torch.int16))


def _group_rows(t: torch.Tensor, counts: list[int], tokens: int) -> list[torch.Tensor]:
    return [t[start:start + n] for start, n, _, _ in _placement(counts, tokens)]


def _unquantized_product_and_bound(dy: torch.Tensor, x: torch.Tensor, counts: list[int],
                                   tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group, dy_e^T x_e in float64 from the unquantized operands, and how far an FP8 product of them may be:
    e4m3 keeps 3 mantissa bits, so a value v of a block with scale s is off by at most 2^-4 |v| + 2^-10 s (half the
    subnormal step, 2^-9 s), and s <= (the channel's largest |value|, floored at 1e-4) / 448; the product's error
    sums e_dy |x| + |dy| e_x + e_dy e_x over the group's tokens."""
    def error(t: torch.Tensor) -> torch.Tensor:
        peak = t.abs().max(dim=0, keepdim=True).values.clamp_min(1e-4) if len(t) else t.new_zeros(1, t.shape[1])
        return 2 ** -4 * t.abs() + 2 ** -10 * peak / 448

    exact, bound = [], []
    for a, b in zip(*(_group_rows(t.double(), counts, tokens) for t in (dy, x))):
        ea, eb = error(a), error(b)
        exact.append(a.t() @ b)
        bound.append(ea.t() @ b.abs() + a.abs().t() @ eb + ea.t() @ eb)
    return torch.stack(exact), torch.stack(bound)


def test_bad_arguments_raise_value_error() -> None:
    """The Python checks of the quantizer, weight_grad and wgrad_gemm name what is wrong (before any GPU work)."""
    dy, x, counts = _inputs(Case((3, 5), 64, 64))
    with pytest.raises(ValueError, match="t must be"):
        fw.quantize_k_grouped(dy[0], counts)
    with pytest.raises(ValueError, match="counts must be"):
        fw.quantize_k_grouped(dy, counts.float())
    with pytest.raises(ValueError, match="one P"):
        fw.weight_grad(dy, x[:4], counts)
    q, s = fw.quantize_k_grouped(dy, counts)
    qx, sx = fw.quantize_k_grouped(x, counts)
    good = dict(a=q, a_scale=s, b=qx, b_scale=sx, counts=counts, tokens=8)
    for change, message in (
            ({"a": q.float()}, "a must be"), ({"b": qx[:, :16].contiguous()}, "columns but b has"),
            ({"b": fw.quantize_k_grouped(x[:, :60].contiguous(), counts)[0]}, "N a positive multiple of 8"),
            ({"tokens": 100}, "k_grouped_columns"), ({"a_scale": s[:10]}, "a_scale must be"),
            ({"b_scale": sx.double()}, "b_scale must be"), ({"counts": counts[None]}, "counts must be"),
            ({}, "must be on a's CUDA device")):
        with pytest.raises(ValueError, match=message):
            sm90.wgrad_gemm(**(good | change))
    with pytest.raises(ValueError, match="out must be"):
        sm90.wgrad_gemm(**good, out=torch.empty(2, 64, 63, dtype=torch.bfloat16))


def test_native_checks_name_the_field() -> None:
    """The module's own wgrad checks (csrc/gemm/bindings.cpp), which need no GPU: a bad field raises ValueError
    naming it."""
    module, why = sm90._module()
    if module is None:
        pytest.skip(why)
    fields = dict(a=16, a_scale=16, b=16, b_scale=16, counts=16, out=16, workspace=128, workspace_bytes=1, m=200,
                  n=264, tokens=100, columns=_round_up(100 + 15 * 4, 16), groups=4, config=0, raster=0, stream=0)
    module.WgradGemmArgs(**fields).check()
    for change, message in (({"m": 0}, "m = 0"), ({"n": 100}, "n = 100"), ({"tokens": -1}, "tokens = -1"),
                            ({"groups": 0}, "groups = 0"), ({"groups": 70000}, "groups = 70000"),
                            ({"columns": 168}, "columns = 168"),
                            ({"columns": 144}, "tokens \\+ 15 \\* groups = 160 exceeds columns = 144"),
                            ({"config": 1}, "config = 1"), ({"raster": 2}, "raster = 2"), ({"b": 0}, "b is null"),
                            ({"out": 8}, "out = 8 is not 16-byte aligned"), ({"workspace": 64}, "workspace = 64")):
        with pytest.raises(ValueError, match=f"fp8_wgrad_gemm: {message}"):
            module.WgradGemmArgs(**(fields | change)).check()
    assert set(module.WGRAD_TILE_CONFIGS) == {"cooperative_128x128"}
    assert module.GROUP_COLUMN_ALIGN == sm90.GROUP_COLUMN_ALIGN


# ---- the Triton quantizer, interpreted on the CPU -------------------------------------------------
def interpreted_kernel_cases() -> None:
    """Entry of the interpreter subprocess (TRITON_INTERPRET=1 set before Triton loads): the kernel writes its
    values into a float32 q_t (the interpreter's own e4m3 rounding is loose), rounded here by torch's cast; the
    result, the tail zeros and the scales must be the torch version's bits."""
    import triton

    extra = [Case((128, 128, 128, 1), 130, 64), Case((0, 5), 64, 64, tokens=0),
             Case((129, 129, 129, 1), 64, 64, tokens=2000)]  # most columns past the last group: idle programs zero them
    for index, case in enumerate(CPU_CASES + extra):
        t, _, counts = _inputs(case)
        p, c = t.shape
        if index % 2:  # a column slice of a wider tensor (rows further apart than c), as dH13's gate and up halves
            t = torch.cat([t, torch.randn(p, 24, dtype=t.dtype)], dim=1)[:, :c]
        e = counts.numel()
        columns, blocks = fw.k_grouped_columns(p, e), fw.k_grouped_scale_blocks(p, e)
        q = torch.full((c, columns), float("nan"))
        s = torch.full((c * blocks,), float("nan"))
        fw._quantize_k_grouped_kernel[(blocks, triton.cdiv(c, 64))](t, counts, q, s, p, c, e, columns, t.stride(0),
                                                                     EP=16, BC=64, TAIL=fw._TAIL)
        want_q, want_s = fw.quantize_k_grouped_torch(t, counts)
        assert torch.equal(q.to(torch.float8_e4m3fn).view(torch.uint8), want_q.view(torch.uint8)), f"{case}: q_t"
        assert torch.equal(s.view(torch.int32), want_s.view(torch.int32)), f"{case}: scales"


def test_triton_quantizer_in_interpreter() -> None:
    run_interpreted("tests.test_fp8_wgrad", "interpreted_kernel_cases")


# ---- GPU -------------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
needs_sm90 = pytest.mark.skipif(not sm90.available(), reason=str(sm90.unavailable_reason()))


def _router_counts(tokens: int, experts: int, topk: int, seed: int) -> tuple[int, ...]:
    """Pairs per expert of `tokens` tokens routed top-k over random scores (uneven; some experts may get none)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randn(tokens, experts, generator=g).topk(topk, dim=1).indices
    return tuple(torch.bincount(idx.flatten(), minlength=experts).tolist())


GPU_CASES = CPU_CASES + [
    Case((1, 0, 300, 129, 0, 127, 128, 2048), 512, 1024),  # a group of 1 token, empty ones, many K blocks
    Case((0, 0, 700), 256, 384, tokens=600),  # one group with every token, clipped
    Case((5, 0, 260), 144, 264),  # partial M and N tiles (N: 2 tiles + 8 columns)
    Case(_router_counts(256, 64, 8, seed=5), 384, 256),  # 64 experts, router-like
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("index", range(len(GPU_CASES)))
def test_triton_quantizer_matches_torch_version(index: int) -> None:
    """The Triton quantizer (counts on the device, int32 and int64) against the torch version, bit for bit, also on
    a column slice (rows further apart than its width)."""
    case = GPU_CASES[index]
    dy, x, counts = _inputs(case)
    for t, on_gpu in ((dy, dy.cuda()), (x, x.cuda()), (dy[:, 3:], dy.cuda()[:, 3:])):  # the slice sliced on the GPU
        want_q, want_s = fw.quantize_k_grouped_torch(t, counts)
        for c in (counts, counts.long()):
            q, s = fw.quantize_k_grouped(on_gpu, c.cuda())
            assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8)), f"{case}: q_t"
            assert torch.equal(s.cpu().view(torch.int32), want_s.view(torch.int32)), f"{case}: scales"


def _cutlass_case(case: Case) -> None:
    """wgrad_gemm on operands the Triton quantizer made, out poisoned with NaN, against the float64 oracle computed
    on the GPU, for every compiled tile config: empty groups exactly 0; the same bits on a second run; the torch
    path within two roundings."""
    dy, x, counts = _inputs(case, device="cuda")
    q_dy, s_dy = fw.quantize_k_grouped(dy, counts)
    q_x, s_x = fw.quantize_k_grouped(x, counts)
    host_counts = list(case.counts)
    want = _wgrad_f64(q_dy, s_dy, q_x, s_x, host_counts, case.rows)
    torch_path = fw._k_grouped_gemm_torch(q_dy, s_dy, q_x, s_x, counts, case.rows)
    for tiles in sorted(sm90._module()[0].WGRAD_TILE_CONFIGS):
        config = sm90.GemmConfig(tiles=tiles)
        outs = []
        for _ in range(2):
            out = torch.full((len(case.counts), case.m, case.n), float("nan"), dtype=torch.bfloat16, device="cuda")
            assert sm90.wgrad_gemm(q_dy, s_dy, q_x, s_x, counts, case.rows, out=out, config=config) is out
            outs.append(out)
        torch.cuda.synchronize()
        where = f"{case} {tiles}"
        _within(outs[0], want, where)
        _empty_groups_zero(outs[0], host_counts, case.rows, where)
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), f"{where}: bits differ between runs"
        _within(outs[0], torch_path.double(), f"{where} against the torch path", steps=2.0)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("index", range(len(GPU_CASES)))
def test_cutlass_wgrad_matches_oracle(index: int) -> None:
    _cutlass_case(GPU_CASES[index])


@pytest.mark.gpu
@needs_sm90
def test_cutlass_wgrad_bench_size() -> None:
    """The bench's shape: E = 8, M = 7168, N = 2048, random counts averaging 256 tokens (one of them empty)."""
    g = torch.Generator().manual_seed(9)
    counts = torch.multinomial(torch.rand(8, generator=g) + 0.2, 2048, replacement=True, generator=g)
    counts = torch.bincount(counts, minlength=8)
    counts[3] += counts[5]
    counts[5] = 0
    _cutlass_case(Case(tuple(counts.tolist()), 7168, 2048))


@pytest.mark.gpu
@needs_cuda
def test_weight_grad_on_gpu_has_no_host_sync() -> None:
    """weight_grad with counts on the device runs without a host synchronisation (torch's sync debug mode raises
    on one), and gives the CPU path's result within two bf16 roundings."""
    case = Case((0, 1, 127, 128, 129, 300), 256, 384)
    dy, x, counts = _inputs(case)
    want = fw.weight_grad(dy, x, counts).double()
    args = [t.cuda() for t in (dy, x, counts)]
    fw.weight_grad(*args)  # compile the Triton kernel first
    torch.cuda.synchronize()
    if sm90.available():
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = fw.weight_grad(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:  # the torch path reads the counts on the host
        got = fw.weight_grad(*args)
    _within(got.cpu(), want, "weight_grad on the GPU against the CPU", steps=2.0)
