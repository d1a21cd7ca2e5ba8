"""Sampler: one row of logits per sampling request -> one token each, plus logprobs.

Order of operations (as in vLLM): raw logprobs for reporting -> min_tokens
suppression -> logit bias -> penalties -> greedy argmax, or temperature -> top-k -> top-p ->
min-p -> a draw. The draw is argmax(probs / q) with q ~ Exp(1) per vocabulary
entry, which samples from `probs` without a device sync; a request with a seed
draws its q from its own generator, so its tokens do not depend on the batch.
"""

from __future__ import annotations

from typing import Optional

import torch

from streamserve.engine.scheduler_output import TokenLogprobs
from streamserve.worker.request_state import RequestState as SamplingRow


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]
                 ) -> tuple[list[int], Optional[list[Optional[TokenLogprobs]]]]:
        logits = logits.float()
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if any(r.params.min_tokens for r in rows):
            logits = _suppress_stops(logits, rows)
        if any(r.params.logit_bias for r in rows):
            logits = _add_logit_bias(logits, rows)
        if any(r.params.has_penalties for r in rows):
            logits = apply_penalties(logits, rows)
        tokens = self._choose(logits, rows)
        token_list = tokens.tolist()
        logprobs = None if raw_logprobs is None else _gather_logprobs(raw_logprobs, tokens, rows)
        return token_list, logprobs

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if all(r.params.greedy for r in rows):
            return greedy
        temps = torch.tensor([r.params.temperature or 1.0 for r in rows], device=logits.device)
        probs = _filtered_probs(logits / temps.unsqueeze(1), rows)
        q = torch.empty_like(probs)
        for i, r in enumerate(rows):
            if r.generator is not None:
                q[i].exponential_(generator=r.generator)
        if any(r.generator is None for r in rows):
            unseeded = torch.tensor([r.generator is None for r in rows], device=logits.device)
            q = torch.where(unseeded.unsqueeze(1), torch.empty_like(probs).exponential_(
                generator=self.generator), q)
        sampled = (probs / q).argmax(dim=-1)
        is_greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
        return torch.where(is_greedy, greedy, sampled)


def _filtered_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """softmax after top-k, top-p and min-p (each only if some row asks for it)."""
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = [r.params.min_p for r in rows]
    if any(min_p):
        threshold = torch.tensor(min_p, device=probs.device).unsqueeze(1) * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= ks.unsqueeze(1)
    ps = torch.tensor(top_p, device=logits.device).unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Drop a token once the mass before it already reaches top_p (the first always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= ps) & (ps < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _suppress_stops(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Below min_tokens, EOS and stop_token_ids cannot be sampled."""
    logits = logits.clone()
    for i, r in enumerate(rows):
        if len(r.output_token_ids) < r.params.min_tokens:
            banned = set(r.params.stop_token_set)
            if r.eos_token_id is not None:
                banned.add(r.eos_token_id)
            if banned:
                logits[i, list(banned)] = float("-inf")
    return logits


def _add_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """OpenAI's logit_bias: each listed token's bias added to its logit."""
    logits = logits.clone()
    for i, r in enumerate(rows):
        if r.params.logit_bias:
            ids = torch.tensor(list(r.params.logit_bias), device=logits.device)
            logits[i].index_add_(0, ids, torch.tensor(list(r.params.logit_bias.values()),
                                                      dtype=logits.dtype, device=logits.device))
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (divide positive logits,
    multiply negative ones); presence and frequency penalties over output tokens."""
    b, vocab = logits.shape
    device = logits.device
    out_counts = torch.zeros(b, vocab, device=device)
    seen = torch.zeros(b, vocab, dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        if r.output_token_ids:
            ids = torch.tensor(r.output_token_ids, device=device)
            out_counts[i].index_add_(0, ids, torch.ones(len(ids), device=device))
        if r.params.repetition_penalty != 1.0 and r.prompt_token_ids:
            seen[i, torch.tensor(r.prompt_token_ids, device=device)] = True
    seen |= out_counts > 0
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=device).unsqueeze(1)
    return logits - freq * out_counts - pres * (out_counts > 0).float()


def _gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor,
                     rows: list[SamplingRow]) -> list[Optional[TokenLogprobs]]:
    sampled = raw.gather(1, tokens.unsqueeze(1))
    ranks = (raw > sampled).sum(dim=-1) + 1
    max_n = max(r.params.logprobs or 0 for r in rows)
    top_vals, top_ids = (raw.topk(max_n, dim=-1) if max_n else (None, None))
    sampled_l, ranks_l = sampled.squeeze(1).tolist(), ranks.tolist()
    top_vals_l = top_vals.tolist() if max_n else None
    top_ids_l = top_ids.tolist() if max_n else None
    result: list[Optional[TokenLogprobs]] = []
    for i, r in enumerate(rows):
        n = r.params.logprobs
        if n is None:
            result.append(None)
        else:
            result.append(TokenLogprobs(sampled_l[i], ranks_l[i],
                                        top_ids_l[i][:n] if n else [], top_vals_l[i][:n] if n else []))
    return result
