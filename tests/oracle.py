"""Brute-force expected results over all ranks' inputs, written as plain loops (independent of any backend)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch



# ---- FP8 (e4m3) from the format's definition (docs/api.md), not moe_ep.comm.fp8 ----------------
E4M3_MAX = 448.0  # 1.75 * 2^8, the largest finite e4m3fn value
E4M3_MIN_NORMAL_EXP = -6  # 2^-6: the smallest normal magnitude; below it the step is 2^-9
AMAX_FLOOR = 1e-4  # docs/api.md: amax = max(max|x|, 1e-4)


def _f32_quotient(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b for float32 a, b, correctly rounded to float32: the float64 quotient rounded once (float64
    carries more than 2 * 24 + 2 bits, so the double rounding is exact), not torch's float32 division."""
    return (a.double() / b.double()).float()


def e4m3_bits(v: torch.Tensor) -> torch.Tensor:
    """float32 values -> their e4m3fn encodings (uint8): round to nearest, ties to even, magnitudes
    past 448 saturate to 448; built from sign, exponent and mantissa fields (no float8 cast)."""
    v = v.double()
    mag = v.abs()
    _, exp = torch.frexp(mag)  # mag = m * 2^exp, m in [0.5, 1): the leading bit is 2^(exp - 1)
    lead = torch.clamp(exp - 1, min=E4M3_MIN_NORMAL_EXP)
    step = torch.ldexp(torch.ones_like(mag), lead - 3)  # 3 mantissa bits below the leading one
    q = torch.round(mag / step) * step  # torch.round: half to even; mag / step is exact (power of two)
    q = torch.clamp(q, max=E4M3_MAX)
    _, qexp = torch.frexp(q)
    normal = q >= 2.0 ** E4M3_MIN_NORMAL_EXP
    field_exp = torch.where(normal, qexp - 1 + 7, torch.zeros_like(qexp))
    unit = torch.ldexp(torch.ones_like(q), torch.where(normal, qexp - 1 - 3, torch.full_like(qexp, -9)))
    mant = (q / unit).long() - torch.where(normal, 8, 0)
    sign = torch.signbit(v).long()
    return (sign << 7 | field_exp.long() << 3 | mant).to(torch.uint8)


def fp8_scales(amax: torch.Tensor, round_scale: bool = False) -> torch.Tensor:
    """float32 block amax -> float32 scales: max(amax, 1e-4) / 448, or with round_scale the smallest
    power of two >= that quotient."""
    floored = torch.maximum(amax.float(), torch.tensor(AMAX_FLOOR, dtype=torch.float32))
    scale = _f32_quotient(floored, torch.full_like(floored, E4M3_MAX))
    if round_scale:
        mantissa, exp = torch.frexp(scale.double())
        scale = torch.where(mantissa == 0.5, scale.double(), torch.ldexp(torch.ones_like(scale.double()), exp)).float()
    return scale


def fp8_quantize(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 block format by definition, on the CPU: x [..., H] (H % 128 == 0) -> (e4m3 [..., H],
    float32 scales [..., H / 128]); per 128 channels scale = max(amax, 1e-4) / 448 (float32), values
    x / scale in float32, then e4m3 by round to nearest even with saturation."""
    x = x.detach().cpu().float()
    lead, h = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(*lead, h // 128, 128)
    scale = fp8_scales(blocks.abs().amax(-1), round_scale)
    bits = e4m3_bits(_f32_quotient(blocks, scale.unsqueeze(-1)))
    return bits.view(torch.float8_e4m3fn).reshape(*lead, h), scale


def fp8_quantize_weight_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (e4m3 [E, N, K], float32 scales [E, N / 128, K / 128]): the same rule with one
    scale per 128 x 128 block (the FP8 experts' weights)."""
    w = w.detach().cpu().float()
    e, n, k = w.shape
    blocks = w.reshape(e, n // 128, 128, k // 128, 128)
    scale = fp8_scales(blocks.abs().amax(dim=(2, 4)))
    bits = e4m3_bits(_f32_quotient(blocks, scale[:, :, None, :, None]))
    return bits.view(torch.float8_e4m3fn).reshape(e, n, k), scale


def fp8_dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 values of e4m3 q [..., H] times their per-128-channel scales [..., H / 128]."""
    return q.double() * scales.double().repeat_interleave(128, dim=-1)


@dataclass
class Inputs:
    """Every rank's inputs for one case, generated identically on every rank from a seed."""

    x: list[torch.Tensor]  # per rank [N_r, H] bf16
    topk_idx: list[torch.Tensor]  # per rank [N_r, K] int64
    topk_weights: list[torch.Tensor]  # per rank [N_r, K] float32


def make_inputs(seed: int, tokens: list[int], hidden: int, num_experts: int, num_topk: int,
                routing: str = "random") -> Inputs:
    """Fresh random rows and routing. routing: 'random' (distinct experts, ~15% -1), 'one_expert'
    (every token picks expert num_experts // 2 once), 'skewed' (most picks in the first experts,
    duplicates allowed), 'first_experts' (random_topk's)."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for n in tokens:
        x = (torch.randn(n, hidden, generator=g) * 2).to(torch.bfloat16)
        if routing == "random":
            scores = torch.rand(n, num_experts, generator=g)
            idx = scores.topk(num_topk, dim=1).indices
            idx = torch.where(torch.rand(n, num_topk, generator=g) < 0.15, -1, idx)
        elif routing == "one_expert":
            idx = torch.full((n, num_topk), -1, dtype=torch.int64)
            idx[:, 0] = num_experts // 2
        elif routing == "skewed":
            idx = (torch.rand(n, num_topk, generator=g) ** 3 * num_experts).long()
            idx = torch.where(torch.rand(n, num_topk, generator=g) < 0.1, -1, idx)
        elif routing == "first_experts":
            idx = random_topk(routing, n, num_experts, num_topk, g, device="cpu")
        else:
            raise ValueError(routing)
        xs.append(x)
        idxs.append(idx.to(torch.int64).contiguous())
        ws.append(torch.rand(n, num_topk, generator=g, dtype=torch.float32))
    return Inputs(xs, idxs, ws)


def random_topk(kind: str, n: int, experts: int, k: int, g: torch.Generator, device: str = "cuda") -> torch.Tensor:
    """Expert ids on `device`: distinct with ~15% -1 ('random'), duplicates toward low ids ('skewed'),
    one expert listed in every other slot and -1 between ('one_expert'), all -1 ('none'), or k distinct ids
    among the first 2k experts, none -1 ('first_experts': at 2k <= E_l every token's k pairs on rank 0)."""
    if kind == "random":
        idx = torch.rand(n, experts, generator=g, device=device).topk(k, dim=1).indices
        drop = torch.rand(n, k, generator=g, device=device) < 0.15
    elif kind == "first_experts":
        idx = torch.rand(n, min(2 * k, experts), generator=g, device=device).topk(k, dim=1).indices
        drop = torch.zeros(n, k, dtype=torch.bool, device=device)
    elif kind == "skewed":
        idx = (torch.rand(n, k, generator=g, device=device) ** 3 * experts).long()
        drop = torch.rand(n, k, generator=g, device=device) < 0.1
    elif kind == "one_expert":
        idx = torch.full((n, k), experts // 2, dtype=torch.int64, device=device)
        drop = torch.zeros(n, k, dtype=torch.bool, device=device)
        drop[:, 1::2] = True
    elif kind == "none":
        idx = torch.zeros(n, k, dtype=torch.int64, device=device)
        drop = torch.ones(n, k, dtype=torch.bool, device=device)
    else:
        raise ValueError(kind)
    return torch.where(drop, -1, idx).contiguous()


def owners(idx_row: list[int], num_local: int) -> set[int]:
    return {e // num_local for e in idx_row if e >= 0}


def expected_layout(inp: Inputs, me: int, world: int, num_experts: int):
    idx = inp.topk_idx[me].tolist()
    num_local = num_experts // world
    in_rank = torch.zeros(len(idx), world, dtype=torch.bool)
    per_expert = torch.zeros(num_experts, dtype=torch.int32)
    for n, row in enumerate(idx):
        for r in owners(row, num_local):
            in_rank[n, r] = True
        for e in set(row) - {-1}:
            per_expert[e] += 1
    return in_rank.sum(0, dtype=torch.int32), per_expert, in_rank


@dataclass
class ExpectedDispatch:
    x: torch.Tensor
    scales: Optional[torch.Tensor]
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    src_rank: list[int]
    src_index: list[int]
    tokens_per_expert: list[int]  # not aligned


def expected_dispatch(inp: Inputs, me: int, world: int, num_experts: int,
                      scales: Optional[list[torch.Tensor]] = None) -> ExpectedDispatch:
    num_local = num_experts // world
    rows, srows, tk, tw, sr, si = [], [], [], [], [], []
    for s in range(world):
        for n, row in enumerate(inp.topk_idx[s].tolist()):
            if me not in owners(row, num_local):
                continue
            rows.append(inp.x[s][n])
            if scales is not None:
                srows.append(scales[s][n])
            local = [e - me * num_local if e >= 0 and e // num_local == me else -1 for e in row]
            tk.append(local)
            tw.append([float(w) if l >= 0 else 0.0 for w, l in zip(inp.topk_weights[s][n].tolist(), local)])
            sr.append(s)
            si.append(n)
    h = inp.x[0].shape[1]
    k = inp.topk_idx[0].shape[1]
    per_expert = [sum(1 for row in tk if e in row) for e in range(num_local)]
    return ExpectedDispatch(
        x=torch.stack(rows) if rows else torch.empty(0, h, dtype=inp.x[0].dtype),
        scales=(torch.stack(srows) if srows else torch.empty(0, h // 128)) if scales is not None else None,
        topk_idx=torch.tensor(tk, dtype=torch.int64).reshape(-1, k),
        topk_weights=torch.tensor(tw, dtype=torch.float32).reshape(-1, k),
        src_rank=sr, src_index=si, tokens_per_expert=per_expert,
    )


def _two_level_sums(inp: Inputs, me: int, world: int, num_experts: int, value_of, width: int,
                    ranks_per_node: Optional[int], round_partials: bool) -> torch.Tensor:
    """float32 [N, width]: for each token i of rank me, the sum over its receiving nodes n ascending of
    partial_n, where partial_n is the sum over node n's receiving ranks r ascending of
    float(value_of(r, me, i)), rounded to bf16 when round_partials; both sums in float32 from +0.0.
    ranks_per_node=None: one node."""
    num_local = num_experts // world
    per_node = world if ranks_per_node is None else ranks_per_node
    out = torch.zeros(inp.x[me].shape[0], width, dtype=torch.float32)
    for i, row in enumerate(inp.topk_idx[me].tolist()):
        ranks = sorted(owners(row, num_local))
        acc = torch.zeros(width, dtype=torch.float32)
        for node in sorted({r // per_node for r in ranks}):
            partial = torch.zeros(width, dtype=torch.float32)
            for r in ranks:
                if r // per_node == node:
                    partial = partial + value_of(r, me, i).float()
            acc = acc + (partial.to(torch.bfloat16).float() if round_partials else partial)
        out[i] = acc
    return out


def expected_combine(inp: Inputs, me: int, world: int, num_experts: int, row_of,
                     ranks_per_node: Optional[int] = None) -> torch.Tensor:
    """out[i] = bf16(sum over receiving nodes n ascending of float(partial_n)), where
    partial_n = bf16(sum over node n's receiving ranks r ascending of float(row_of(r, me, i))), both
    sums in float32 from +0.0. ranks_per_node=None: one node, i.e. the flat sum over ranks."""
    h = inp.x[me].shape[1]
    return _two_level_sums(inp, me, world, num_experts, row_of, h, ranks_per_node, True).to(torch.bfloat16)


def expected_combine_weights(inp: Inputs, me: int, world: int, num_experts: int, weights_of,
                             ranks_per_node: Optional[int] = None) -> torch.Tensor:
    """Combined topk_weights [N, K] float32: out_w[i] = sum over receiving nodes n ascending of (sum over
    node n's receiving ranks r ascending of weights_of(r, me, i) [K]), both sums in float32 from +0.0,
    never rounded to bf16. ranks_per_node=None: one node, i.e. the flat sum over ranks."""
    k = inp.topk_idx[me].shape[1]
    return _two_level_sums(inp, me, world, num_experts, weights_of, k, ranks_per_node, False)


def local_weights(inp: Inputs, r: int, s: int, i: int, num_experts: int, world: int) -> torch.Tensor:
    """[K] float32: token i of rank s's weights as rank r received them (0 where the expert is elsewhere)."""
    num_local = num_experts // world
    local = torch.tensor([e >= 0 and e // num_local == r for e in inp.topk_idx[s][i].tolist()])
    return torch.where(local, inp.topk_weights[s][i], 0.0)


@dataclass
class ExpectedLowLatency:
    rows: list[list[torch.Tensor]]  # per local expert, rows in (src rank, token) order
    scales: Optional[list[list[torch.Tensor]]]
    src: list[list[tuple[int, int]]]  # per local expert: (src rank, src index)


def expected_low_latency_dispatch(inp: Inputs, me: int, world: int, num_experts: int,
                                  use_fp8: bool, round_scale: bool) -> ExpectedLowLatency:
    num_local = num_experts // world
    rows: list[list[torch.Tensor]] = [[] for _ in range(num_local)]
    srows: list[list[torch.Tensor]] = [[] for _ in range(num_local)]
    src: list[list[tuple[int, int]]] = [[] for _ in range(num_local)]
    for s in range(world):
        q, sc = fp8_quantize(inp.x[s], round_scale) if use_fp8 and inp.x[s].shape[0] else (inp.x[s], None)
        for n, row in enumerate(inp.topk_idx[s].tolist()):
            for e in sorted(set(row)):
                if e >= 0 and e // num_local == me:
                    rows[e - me * num_local].append(q[n])
                    if use_fp8:
                        srows[e - me * num_local].append(sc[n])
                    src[e - me * num_local].append((s, n))
    return ExpectedLowLatency(rows, srows if use_fp8 else None, src)


def expected_low_latency_combine(inp: Inputs, me: int, world: int, num_experts: int, expert_row) -> torch.Tensor:
    """out[n] = bf16(acc), acc = +0.0 then acc = acc + w[n,k] * float(expert_row(e, s, n, k)) for k ascending."""
    n_tok, h = inp.x[me].shape
    out = torch.zeros(n_tok, h, dtype=torch.bfloat16)
    for n, row in enumerate(inp.topk_idx[me].tolist()):
        acc = torch.zeros(h, dtype=torch.float32)
        for k, e in enumerate(row):
            if e >= 0:
                acc = acc + inp.topk_weights[me][n, k] * expert_row(e, me, n, k).float()
        out[n] = acc.to(torch.bfloat16)
    return out


def assert_same_bits(got: Optional[torch.Tensor], want: Optional[torch.Tensor], what: str) -> None:
    """got has want's dtype, shape and bytes: NaN payloads and -0.0 count, unlike torch.equal."""
    if want is None:
        assert got is None, f"{what}: expected None, got {type(got).__name__}"
        return
    assert got is not None, f"{what}: expected a tensor, got None"
    assert (got.dtype, got.shape) == (want.dtype, want.shape), \
        f"{what}: {got.dtype} {list(got.shape)} != {want.dtype} {list(want.shape)}"
    # fresh standard strides: a view whose last dim has size 1 may keep any stride there (token-major scales)
    a, b = (t.clone(memory_format=torch.contiguous_format).view(-1).view(torch.uint8) for t in (got, want))
    if not torch.equal(a, b):
        size = want.element_size()
        differ = (a != b).view(-1, size).any(1)
        first = int(differ.nonzero()[0])
        g, w = (t.clone(memory_format=torch.contiguous_format).view(-1)[first].item() for t in (got, want))
        raise AssertionError(f"{what}: differs, first at flat element {first} of {want.numel()} ({g!r} != {w!r}), "
                             f"{int(differ.sum())} elements differ")
