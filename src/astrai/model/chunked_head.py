"""Per-token log-probs through the LM head in chunks of rows: no (rows, vocab) logits tensor.

Every loss that needs log pi(token) (SFT's cross entropy, DPO's sequence log-probs, the RL
objectives and their reference, the entropy metric) calls `head_logps` on the final hidden states
instead of materialising logits. `ChunkedHeadLogps` runs the lm head on `chunk_rows` rows at a
time (logits, temperature, the sampler's top-k / top-p truncation exactly as `apply_truncation`
does, logsumexp, gather, entropy) and keeps only per-row results; its backward recomputes each
chunk's logits from the saved hidden states, weights, targets and per-row logsumexp. So at any
moment at most one (chunk_rows, V) float32 block lives, in forward and in backward; today's path
held the (rows, V) logits, their float32 copy, the log-softmax and its gradient. The truncation
mask is a constant in backward (autograd through `masked_fill` treats it the same way), and is
recomputed per chunk rather than saved. `CausalLM.forward(..., head=...)` calls this inside the
model's forward so FSDP's unshard hooks cover the lm head weight, and a tied head
(`lm_head.weight is embed_tokens.weight`) gets its gradient like any input of a Function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from astrai.model.logprobs import apply_truncation
from astrai.model.matmul import mm_into

# rows per chunk = LOGITS_CHUNK_ELEMENTS // vocab: 341 rows of SmolLM2's 49,152 tokens, a 64 MiB
# float32 block. Measured (benchmarks/bench_rl_scale.py, 135M shape, 8 layers, 1 thread, CPU s per
# step / step RSS): 2**22 8.7 s / 1210 MB, 2**24 7.0 s / 1223 MB, 2**26 6.9 s / 1297 MB: smaller
# chunks pay per-chunk overhead, larger ones hold more memory for no speed
LOGITS_CHUNK_ELEMENTS = 1 << 24


@dataclass
class HeadLogps:
    """Per-row results of `head_logps`, each shaped like the targets."""

    logps: Tensor  # log pi(target) under the (tempered, truncated) distribution; differentiable
    mean_logps: Tensor | None = None  # mean over the vocabulary of log pi (label smoothing); differentiable
    entropy: Tensor | None = None  # entropy of the tempered, untruncated distribution; detached unless entropy_grad


def chunk_rows_for(vocab_size: int) -> int:
    return max(1, LOGITS_CHUNK_ELEMENTS // vocab_size)


def head_logps(hidden: Tensor, lm_head: nn.Module, targets: Tensor, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, smoothing: bool = False, entropy: bool = False,
               chunk_rows: int | None = None, entropy_grad: bool = False, min_p: float = 0.0,
               repetition_penalty: float = 1.0, context: tuple[Tensor, Tensor, Tensor] | None = None) -> HeadLogps:
    """log pi(targets) for hidden states (..., C) through `lm_head` (an nn.Linear), targets (...).

    temperature 0 means greedy: the plain logits, no truncation (as the sampler records it);
    otherwise logits / temperature truncated to top_k, then top_p, then min_p (0 / 1.0 / 0: off), with
    the target always kept. `repetition_penalty` (!= 1) acts first, as the engine's does (vLLM's
    semantics): the raw logit of every token already in the row's context is divided by it when
    positive, multiplied when not; `context` = (input_ids (B, T), rows (N,), cols (N,)) says each
    row's context, input_ids[rows, :cols + 1] (the row predicts the token after column cols). `smoothing` adds mean_v log pi_v (untruncated only), `entropy` the entropy of
    the tempered untruncated distribution, both per row; `entropy_grad` makes that entropy
    differentiable (an entropy bonus in a loss: dH/dz_v = -p_v (log p_v + H), recomputed per chunk
    in backward like the rest).
    """
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    V = weight.size(0)
    truncate = temperature > 0 and ((0 < top_k < V) or top_p < 1.0 or min_p > 0)
    if smoothing and truncate:
        raise ValueError(f"label smoothing needs the untruncated distribution, got top_k={top_k}, top_p={top_p}, "
                         f"min_p={min_p}; set top_k 0, top_p 1.0 and min_p 0")
    shape = targets.shape
    flat = hidden.reshape(-1, hidden.size(-1))  # (N, C)
    rows = chunk_rows or chunk_rows_for(V)
    options = (float(temperature), int(top_k) if truncate and 0 < top_k < V else V,
               float(top_p) if truncate else 1.0, bool(smoothing), bool(entropy), rows, bool(entropy and entropy_grad),
               float(min_p) if truncate else 0.0)
    if repetition_penalty != 1.0 and context is None:
        raise ValueError("repetition_penalty needs each row's context (input_ids, rows, cols) to know the seen tokens")
    penalty = Penalty(float(repetition_penalty), *context) if repetition_penalty != 1.0 else None
    logps, means, ent = ChunkedHeadLogps.apply(flat, weight, bias, targets.reshape(-1), (*options, penalty))
    return HeadLogps(logps.reshape(shape), means.reshape(shape) if smoothing else None,
                     ent.reshape(shape) if entropy else None)


def _block(h: Tensor, weight: Tensor, rows: int) -> Tensor | None:
    """The (rows, V) float32 block a call writes each chunk's logits into, or None where the
    product would not run in float32 (low-precision weights, autocast): those chunks allocate.
    One block reused from chunk to chunk saves a fresh 64 MiB allocation per chunk, whose page
    faults on a CPU cost about as much as a pass over it."""
    if h.dtype != torch.float32 or weight.dtype != torch.float32 or torch.is_autocast_enabled(h.device.type):
        return None
    return torch.empty(min(rows, h.size(0)), weight.size(0), dtype=torch.float32, device=h.device)


@dataclass
class Penalty:
    """The repetition penalty of a call: its value and where each row's context is."""

    value: float
    input_ids: Tensor  # (B, T)
    rows: Tensor  # (N,) the row of input_ids each head row reads
    cols: Tensor  # (N,) its last context column

    def seen(self, sl: slice, vocab_size: int) -> Tensor:
        """(n, V) bool: the tokens of each row of chunk `sl`'s context."""
        rows, cols = self.rows[sl], self.cols[sl]
        ids = self.input_ids[rows]  # (n, T)
        inside = torch.arange(ids.size(1), device=ids.device)[None] <= cols[:, None]
        ids = torch.where(inside, ids, vocab_size)  # outside: an extra column, dropped
        seen = torch.zeros(ids.size(0), vocab_size + 1, dtype=torch.bool, device=ids.device)
        return seen.scatter_(1, ids, True)[:, :vocab_size]

    def factor(self, raw: Tensor, seen: Tensor) -> Tensor:
        """d penalised / d raw logit (n, V): 1 / value (seen, positive), value (seen, not), else 1."""
        rep = raw.new_tensor(self.value)
        return torch.where(seen, torch.where(raw > 0, 1 / rep, rep), torch.ones_like(raw))


def _tempered(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, block: Tensor | None,
              penalty: tuple[Penalty, Tensor] | None = None) -> Tensor:
    """One chunk's float32 logits (n, V), repetition-penalised when `penalty` (with the chunk's
    seen mask) is given, / temperature (greedy, 0: as they are), written into `block` (from
    `_block`) when there is one."""
    if block is None:
        z = nn.functional.linear(h, weight, bias).float()  # (n, V), this chunk's own
    else:
        z = block[: h.size(0)]
        if bias is None:
            mm_into(h, weight.t(), z)
        else:
            torch.addmm(bias, h, weight.t(), out=z)
    if penalty is not None:  # as infer/sampling.py's apply_penalties, in float32
        rep = z.new_tensor(penalty[0].value)
        z = torch.where(penalty[1], torch.where(z > 0, z / rep, z * rep), z)
    return z.div_(temperature) if temperature > 0 and temperature != 1.0 else z  # x / 1 == x: skip the pass


def _truncated(z: Tensor, targets: Tensor, options: tuple) -> Tensor:
    """Tempered logits (n, V) as the sampler truncates them: top_k, then top_p, masked entries
    -inf, the target always kept (chosen on these values, so a constant for the gradient)."""
    temperature, top_k, top_p, min_p = *options[:3], options[7]
    n, V = z.shape
    if temperature <= 0 or (top_k >= V and top_p >= 1.0 and min_p <= 0):
        return z
    k = torch.full((n,), top_k, device=z.device)
    p = torch.full((n,), top_p, device=z.device)
    kept = torch.isfinite(apply_truncation(z, k, p, torch.full((n,), min_p, device=z.device)))  # (n, V)
    kept[torch.arange(n, device=z.device), targets] = True
    return z.masked_fill(~kept, -math.inf)


class ChunkedHeadLogps(torch.autograd.Function):
    """(hidden (N, C), weight (V, C), bias (V,) | None, targets (N,)) -> (log pi(target) (N,),
    mean_v log pi_v (N,), entropy (N,)), the lm head applied chunk by chunk (see the module)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                options: tuple) -> tuple[Tensor, Tensor, Tensor]:
        temperature, _, _, smoothing, want_entropy, rows, entropy_grad, min_p, penalty = options
        N = hidden.size(0)
        logps = hidden.new_zeros(N, dtype=torch.float32)
        lse = torch.zeros_like(logps)
        means = torch.zeros_like(logps)
        ent = torch.zeros_like(logps)
        block = _block(hidden, weight, rows)
        # the one-exp-pass entropy runs only on untruncated chunks (`z is tempered` below)
        truncates = temperature > 0 and (options[1] < weight.size(0) or options[2] < 1.0 or min_p > 0)
        p_block = torch.empty_like(block) if block is not None and want_entropy and not truncates else None
        for start in range(0, N, rows):
            sl = slice(start, start + rows)
            seen = (penalty, penalty.seen(sl, weight.size(0))) if penalty is not None else None
            tempered = _tempered(hidden[sl], weight, bias, temperature, block, seen)  # (n, V)
            z = _truncated(tempered, targets[sl], options)
            logps[sl] = z.gather(-1, targets[sl, None]).squeeze(-1)
            if smoothing:
                means[sl] = z.mean(dim=-1)
            if want_entropy and z is tempered:
                # one exp pass serves both: lse = m + log sum p', entropy = lse - sum p' z / sum p'
                # with p' = exp(z - m); p' is the chunk's only other (n, V) block
                m = z.amax(dim=-1, keepdim=True)
                p = torch.sub(z, m, out=p_block[: z.size(0)]) if p_block is not None else torch.sub(z, m)
                p.exp_()
                total = p.sum(dim=-1)
                lse[sl] = m.squeeze(-1) + total.log()
                # sum_v p' z as a batched (1, V) x (V, 1) product: no (n, V) product block
                ent[sl] = lse[sl] - torch.bmm(p[:, None], z[:, :, None])[:, 0, 0] / total
                del p
            else:
                lse[sl] = torch.logsumexp(z, dim=-1)
                if want_entropy:  # of the tempered distribution before truncation, as the metric always was
                    lp = torch.log_softmax(tempered, dim=-1)
                    ent[sl] = -torch.linalg.vecdot(lp.exp(), lp)
            logps[sl] -= lse[sl]
            if smoothing:
                means[sl] -= lse[sl]
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.options = options
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logps, means, ent

    @staticmethod
    def backward(ctx, g_logps: Tensor, g_means: Tensor, g_ent: Tensor) -> tuple:
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        temperature, _, _, smoothing, _, rows, entropy_grad, _, penalty = ctx.options
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        # every row of g_h is written, chunk by chunk
        g_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        g_w = None  # float32 (V, C): the first chunk's product, then accumulated into
        g_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        V = weight.size(0)
        block = _block(hidden, weight, rows)
        for start in range(0, hidden.size(0), rows):
            sl = slice(start, start + rows)
            h, t = hidden[sl], targets[sl]
            factor = None
            if penalty is not None:  # the penalty's slope, from the raw logits (before the block is reused)
                seen = penalty.seen(sl, V)
                factor = penalty.factor(nn.functional.linear(h, weight, bias).float(), seen)
            tempered = _tempered(h, weight, bias, temperature, block, (penalty, seen) if penalty is not None else None)
            scale = 1.0 / temperature if temperature > 0 and temperature != 1.0 else 1.0
            dz_ent = None
            if entropy_grad:  # d/dz of ge * H, H of the untruncated tempered distribution: -ge p (log p + H)
                lp = torch.log_softmax(tempered, dim=-1)  # (n, V)
                dz_ent = lp.exp().mul_(lp.add_(ent[sl, None])).mul_((-g_ent[sl].float() * scale)[:, None])
            z = _truncated(tempered, t, ctx.options)
            probs = z.sub_(lse[sl, None]).exp_()  # in place (z is this chunk's own); 0 where truncated
            ga = g_logps[sl].float()
            total = ga + g_means[sl].float() if smoothing else ga
            # d/dz of ga * log p_t + gm * mean_v log p_v, with the 1 / temperature of the tempering
            dz = probs.mul_(-total[:, None] * scale)
            dz[torch.arange(dz.size(0), device=dz.device), t] += ga * scale
            if smoothing:
                dz += g_means[sl].float()[:, None] * (scale / V)
            if dz_ent is not None:
                dz += dz_ent
            if factor is not None:
                dz *= factor
            dz = dz.to(weight.dtype)
            if need_h:
                if g_h.dtype == dz.dtype == weight.dtype:
                    mm_into(dz, weight, g_h[sl])
                else:
                    g_h[sl] = dz @ weight
            if need_w:
                if g_w is None and dz.dtype == torch.float32:
                    g_w = torch.mm(dz.t(), h, out=dz.new_empty(V, h.size(1)))  # BLAS, as addmm_ below
                elif g_w is None:
                    g_w = (dz.t() @ h).float()
                elif g_w.dtype == dz.dtype:
                    g_w.addmm_(dz.t(), h)  # no (V, C) temporary (BLAS: see mm_into)
                else:
                    g_w += (dz.t() @ h).float()
            if need_b:
                g_b += dz.float().sum(dim=0)
        if need_w and g_w is None:  # no rows
            g_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        return (g_h, g_w.to(weight.dtype) if need_w else None, g_b.to(bias.dtype) if need_b else None, None, None)
