"""`torchrun --nproc-per-node R -m moe_ep.train`: train a small MoE transformer LM with expert parallelism.

The experts of every MoE layer are sharded over all R ranks (one moe_ep.Buffer per run); everything
else (embeddings, attention, norms, routers) is replicated and trained data-parallel: its gradients
are averaged with an all-reduce. The global batch (--batch sequences) is split evenly over the
ranks, so runs with the same seed see the same data and follow the same loss curve at any R.
Runs on CPU (gloo, reference backend) and on GPUs (NCCL, --backend auto picks the native one when
moe_ep.comm._C is built); with fewer GPUs than ranks, --ranks-per-gpu ranks share each GPU over gloo
(docs/one_gpu.md). Each rank writes its own checkpoint file (expert weights under their global
ids); --resume continues from the latest complete step with the same number of ranks.

Runs are deterministic: the same seed gives the same bits on every run, with no global
torch.use_deterministic_algorithms. On CUDA the model avoids the two kernels whose backward adds with
atomics (the embedding lookup and fused attention; see `embed` and `causal_attention`).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from .comm.buffer import Buffer
from .data import CharCorpus
from .moe.experts import GroupedExperts
from .launch import init_distributed, shutdown
from .moe.layer import MoE

# Fields that fix the model's shape and math: a checkpoint only resumes into the same ones.
MODEL_FIELDS = ("seq_len", "dim", "layers", "heads", "experts", "top_k", "ffn", "shared_ffn", "score_func",
                "num_groups", "topk_groups", "capacity_factor", "expert_bias_rate", "dtype", "seed")


def _flag(default: Any, help: str, choices: Optional[tuple[str, ...]] = None) -> Any:
    """A TrainConfig field with its command-line help (and allowed values)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainConfig:
    """Every command-line flag of `python -m moe_ep.train` (defaults: about a minute on 2 CPU cores, 2 ranks)."""

    steps: int = _flag(300, "optimizer steps in total (a resumed run continues up to this number)")
    batch: int = _flag(32, "sequences per step over all ranks (divisible by the number of ranks)")
    seq_len: int = _flag(64, "characters per sequence")
    dim: int = _flag(96, "model width, the Buffer's hidden size (multiple of 8)")
    layers: int = _flag(2, "transformer blocks, each with an MoE feed-forward")
    heads: int = _flag(4, "attention heads")
    experts: int = _flag(8, "routed experts per MoE layer (divisible by the number of ranks)")
    top_k: int = _flag(2, "experts per token")
    ffn: int = _flag(192, "hidden size of each expert")
    shared_ffn: int = _flag(0, "hidden size of the shared expert (0: none)")
    score_func: str = _flag("softmax", "router scores", ("softmax", "sigmoid"))
    num_groups: int = _flag(1, "expert groups for group-limited routing")
    topk_groups: int = _flag(1, "groups each token may route into")
    aux_loss_coef: float = _flag(0.01, "load-balancing loss coefficient")
    z_loss_coef: float = _flag(1e-3, "router z-loss coefficient")
    expert_bias_rate: float = _flag(0.0, "aux-loss-free balancing: expert-bias update rate (0: off)")
    capacity_factor: Optional[float] = _flag(None, "drop selections beyond this multiple of the even load per expert")
    lr: float = _flag(6e-3, "peak learning rate (AdamW)")
    warmup: int = _flag(10, "linear warm-up steps, then cosine decay to a tenth of --lr")
    weight_decay: float = _flag(0.0, "AdamW weight decay")
    clip: float = _flag(1.0, "global gradient-norm clip (0: off)")
    seed: int = _flag(0, "seed of the data and of the initial weights")
    backend: str = _flag("auto", "Buffer backend", ("auto", "reference", "nvshmem"))
    device: str = _flag("auto", "auto: CUDA when present, else CPU with gloo", ("auto", "cpu", "cuda"))
    ranks_per_gpu: Optional[int] = _flag(None, "ranks sharing each GPU over gloo (docs/one_gpu.md; default: 1 when "
                                              "there are enough GPUs, else the local ranks spread evenly)")
    dtype: str = _flag("auto", "compute dtype (auto: bfloat16 on CUDA, float32 on CPU)",
                       ("auto", "float32", "bfloat16"))
    ckpt: str = _flag("checkpoints/moe_ep", "checkpoint root: {ckpt}/step{N}/rank{r}-of-{R}.pt")
    resume: bool = _flag(False, "continue from the latest complete checkpoint under --ckpt")
    save_every: int = _flag(0, "also checkpoint every this many steps (0: only at the end)")
    log_every: int = _flag(10, "print a log line every this many steps")
    progress: bool = _flag(True, "progress bar on rank 0")


# ---- model ------------------------------------------------------------------------------------
def embed(idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight[idx]. On CUDA as a one-hot matmul (the same values), whose weight gradient is a GEMM:
    nn.Embedding's CUDA backward adds rows with atomics, so its bits change from run to run."""
    if idx.is_cuda:
        return F.one_hot(idx, weight.shape[0]).to(weight.dtype) @ weight
    return F.embedding(idx, weight)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal scaled dot-product attention. On CUDA through SDPA's math backend: the fused kernels'
    backward adds dQ with atomics (run-to-run bits) unless torch.use_deterministic_algorithms is on.
    The CPU's fused kernel is deterministic."""
    if q.is_cuda:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, dim: int, heads: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, dtype=dtype, device=device)
        self.out = nn.Linear(dim, dim, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = causal_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block whose feed-forward is the expert-parallel MoE."""

    def __init__(self, cfg: TrainConfig, buffer: Buffer, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.dim, dtype=dtype, device=device)
        self.attn = Attention(cfg.dim, cfg.heads, dtype, device)
        self.norm2 = nn.RMSNorm(cfg.dim, dtype=dtype, device=device)
        self.moe = MoE(buffer, cfg.ffn, score_func=cfg.score_func, num_groups=cfg.num_groups,
                       topk_groups=cfg.topk_groups, aux_loss_coef=cfg.aux_loss_coef, z_loss_coef=cfg.z_loss_coef,
                       expert_bias=cfg.expert_bias_rate > 0, bias_update_rate=cfg.expert_bias_rate,
                       capacity_factor=cfg.capacity_factor, shared_ffn_hidden=cfg.shared_ffn, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x), mode="normal")


class MoELM(nn.Module):
    """Character-level decoder-only LM with MoE feed-forwards and a tied output head."""

    def __init__(self, cfg: TrainConfig, vocab_size: int, buffer: Buffer, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, cfg.dim, dtype=dtype, device=device)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.dim, dtype=dtype, device=device))
        self.blocks = nn.ModuleList(Block(cfg, buffer, dtype, device) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim, dtype=dtype, device=device)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def moe_layers(self) -> list[MoE]:
        return [b.moe for b in self.blocks]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = embed(idx, self.embed.weight) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.embed.weight)


# ---- data-parallel gradient sync --------------------------------------------------------------
def _expert_params(model: nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}


def sync_gradients(model: nn.Module, world: int, clip: float) -> float:
    """Average replicated gradients over ranks; expert gradients already hold every rank's tokens
    (dispatch/combine backward brought them), so they are only divided by R. Then clip by the global
    norm. Returns that norm (before clipping)."""
    experts = _expert_params(model)
    params = [p for p in model.parameters() if p.grad is not None]
    replicated = [p.grad for p in params if id(p) not in experts]
    local = [p.grad for p in params if id(p) in experts]
    if world > 1:
        flat = torch.cat([g.reshape(-1).float() for g in replicated])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for g in replicated:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        for g in local:
            g.div_(world)
    device = params[0].device
    expert_sq = sum((g.float().square().sum() for g in local), torch.zeros((), device=device))
    if world > 1:
        dist.all_reduce(expert_sq)
    replicated_sq = sum((g.float().square().sum() for g in replicated), torch.zeros((), device=device))
    norm = float((expert_sq + replicated_sq).sqrt())
    if clip > 0 and norm > clip:
        for p in params:
            p.grad.mul_(clip / (norm + 1e-6))
    return norm


# ---- checkpoints --------------------------------------------------------------------------------
def rank_file(rank: int, world: int) -> str:
    return f"rank{rank:05d}-of-{world:05d}.pt"


def step_dir(cfg: TrainConfig, step: int) -> str:
    return os.path.join(cfg.ckpt, f"step{step:06d}")


def latest_step(cfg: TrainConfig, world: int) -> Optional[int]:
    """The highest step whose directory holds a complete file for every rank of this world size."""
    if not os.path.isdir(cfg.ckpt):
        return None
    steps = []
    for name in os.listdir(cfg.ckpt):
        match = re.fullmatch(r"step(\d+)", name)
        if match and all(os.path.exists(os.path.join(cfg.ckpt, name, rank_file(r, world))) for r in range(world)):
            steps.append(int(match.group(1)))
    return max(steps, default=None)


def save_checkpoint(cfg: TrainConfig, rank: int, world: int, step: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer, losses: list[float]) -> str:
    """Write this rank's model (experts under global ids), optimizer state and losses to
    {ckpt}/step{step}/rank{r}-of-{R}.pt, atomically (a file that exists is complete)."""
    directory = step_dir(cfg, step)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, rank_file(rank, world))
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "losses": losses,
             "config": {k: getattr(cfg, k) for k in MODEL_FIELDS}, "world_size": world}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    return directory


def load_checkpoint(cfg: TrainConfig, rank: int, world: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer) -> tuple[int, list[float]]:
    """Restore the latest complete checkpoint of this world size; returns (step, losses so far)."""
    step = latest_step(cfg, world)
    if step is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint for {world} rank(s) under {cfg.ckpt}")
    path = os.path.join(step_dir(cfg, step), rank_file(rank, world))
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved = state["config"]
    changed = {k: (saved[k], getattr(cfg, k)) for k in MODEL_FIELDS if saved[k] != getattr(cfg, k)}
    if changed:
        raise ValueError(f"--resume: {path} was written with other settings (saved, now): {changed}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"], state["losses"]


# ---- training loop ------------------------------------------------------------------------------
def _resolve(cfg: TrainConfig) -> tuple[torch.device, torch.dtype]:
    """The current CUDA device unless the run is on CPU (a gloo group may serve ranks sharing a GPU)."""
    on_cuda = cfg.device == "cuda" or (cfg.device == "auto" and dist.get_backend() == "nccl")
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "auto": torch.bfloat16 if device.type == "cuda" else torch.float32}[cfg.dtype]
    return device, dtype


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to 10% of lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train_step(cfg: TrainConfig, model: MoELM, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
               targets: torch.Tensor, world: int) -> tuple[float, float, int, float]:
    """Forward, backward, gradient sync, optimizer step, expert-bias step. Returns the next-character
    loss and router loss averaged over ranks, the selections dropped by capacity on all ranks, and
    the gradient norm."""
    logits = model(inputs)
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    aux = sum(m.aux_loss for m in model.moe_layers())
    optimizer.zero_grad(set_to_none=True)
    (ce + aux).backward()
    grad_norm = sync_gradients(model, world, cfg.clip)
    optimizer.step()
    if cfg.expert_bias_rate > 0:
        for m in model.moe_layers():
            m.update_expert_bias()
    dropped = sum(m.last_routing.num_dropped for m in model.moe_layers())
    stats = torch.stack([ce.detach(), aux.detach().float(), dropped.float().to(ce.device)])
    dist.all_reduce(stats)
    return stats[0].item() / world, stats[1].item() / world, int(stats[2].item()), grad_norm


def train(cfg: TrainConfig) -> list[float]:
    """Run the training loop on the initialised default process group; returns the loss (mean
    next-character cross-entropy over the global batch) of every step, resumed ones included."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {cfg.steps}")
    if cfg.dim % cfg.heads:
        raise ValueError(f"--dim ({cfg.dim}) must be divisible by --heads ({cfg.heads})")
    if cfg.batch % world:
        raise ValueError(f"--batch ({cfg.batch}) must be divisible by the number of ranks ({world})")
    device, dtype = _resolve(cfg)
    local_batch = cfg.batch // world
    corpus = CharCorpus(cfg.seed)
    torch.manual_seed(cfg.seed)
    buffer = Buffer(dist.group.WORLD, hidden=cfg.dim, num_experts=cfg.experts, num_topk=cfg.top_k,
                    max_tokens_per_rank=local_batch * cfg.seq_len, backend=cfg.backend, device=device)
    model = MoELM(cfg, corpus.vocab_size, buffer, dtype, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    start, losses = load_checkpoint(cfg, rank, world, model, optimizer) if cfg.resume else (0, [])
    losses = list(losses)
    tokens_per_step = cfg.batch * cfg.seq_len
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        shared = f" ({buffer.ranks_per_gpu} ranks per GPU)" if buffer.ranks_per_gpu > 1 else ""
        tqdm.write(f"moe_ep.train: {world} rank(s), backend {buffer.backend_name}, {device}{shared}, {dtype}, "
                   f"{params:,} parameters on rank 0, {tokens_per_step} tokens/step, steps {start}..{cfg.steps}")
    path = step_dir(cfg, start)
    bar_off = rank != 0 or not cfg.progress or not sys.stderr.isatty()  # a log gets the log lines only
    with tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=bar_off,
              unit="step", dynamic_ncols=True) as bar:
        for step in bar:
            t0 = time.perf_counter()
            inputs, targets = corpus.batch(step, cfg.batch, cfg.seq_len)
            rows = slice(rank * local_batch, (rank + 1) * local_batch)
            inputs, targets = inputs[rows].to(device), targets[rows].to(device)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(cfg, step)
            loss, aux_mean, dropped, grad_norm = train_step(cfg, model, optimizer, inputs, targets, world)
            losses.append(loss)
            tok_s = tokens_per_step / (time.perf_counter() - t0)
            postfix = {"loss": f"{loss:.4f}", "tok/s": f"{tok_s:,.0f}"}
            if cfg.capacity_factor is not None:
                postfix["dropped"] = dropped
            bar.set_postfix(postfix)
            if rank == 0 and (step + 1) % cfg.log_every == 0:
                tqdm.write(f"step {step + 1:5d} | loss {loss:.4f} | aux {aux_mean:.4f} | grad norm {grad_norm:.3f} | "
                           f"{tok_s:,.0f} tok/s"
                           + (f" | dropped {dropped}" if cfg.capacity_factor is not None else ""))
            if step + 1 == cfg.steps or (cfg.save_every and (step + 1) % cfg.save_every == 0):
                path = save_checkpoint(cfg, rank, world, step + 1, model, optimizer, losses)
    buffer.close()  # collective: only on the success path, where every rank gets here
    if rank == 0:
        tqdm.write(f"done: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}; checkpoint {path}")
    return losses


# ---- command line ------------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> TrainConfig:
    parser = argparse.ArgumentParser(prog="python -m moe_ep.train", description=__doc__.split("\n")[0])
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        kw = {"default": value, "help": f.metadata["help"] + " (default: %(default)s)"}
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        else:
            kind = {"capacity_factor": float, "ranks_per_gpu": int}.get(f.name, type(value))
            parser.add_argument(flag, type=kind, choices=f.metadata["choices"], **kw)
    return TrainConfig(**vars(parser.parse_args(argv)))


def main(argv: Optional[list[str]] = None) -> None:
    cfg = parse_args(argv)
    placement = init_distributed(cfg.device, cfg.ranks_per_gpu)
    cfg = replace(cfg, device=placement.device.type)
    try:
        train(cfg)
    except BaseException:
        dist.destroy_process_group()  # this rank failed: leave without waiting for the others
        raise
    shutdown()  # every rank done: close, finalize and destroy in a safe order (moe_ep.launch)


if __name__ == "__main__":
    main()
