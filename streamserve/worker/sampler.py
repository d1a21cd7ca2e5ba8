"""Sampler: one row of logits per sampling request -> one token each, plus logprobs.

Order of operations (as in vLLM's V1 engine): raw logprobs for reporting -> min_tokens
suppression -> logit bias -> penalties -> greedy argmax, or temperature -> min-p -> top-k
-> top-p -> a draw. The draw is argmax(probs / q) with q ~ Exp(1) per vocabulary entry,
which samples from `probs` without a device sync; a request with a seed draws its q from
its own generator, seeded afresh for each token from (its seed, the token's position): its
tokens depend on neither the batch, a preemption, nor how many rows a step gave it
(speculative decoding's guesses), only on its logits.

The per-row settings and token lists reach the device through `stage` (the runner's
HostStaging: pinned, non-blocking on a GPU), so the only sync in a step is reading the
sampled tokens back.

On the CPU, where the C kernels build (models/cpu_kernels.py), the choice itself (greedy argmax,
temperature, min-p, top-k, top-p, the draw), the penalties and the logprobs run in C instead, in
a few passes over each row: the torch path's sort of the vocabulary, exponential per entry,
[B, V] count tensors and log_softmax cost 0.1-0.3 s a step at batch 64 of a 49152-token
vocabulary. Its draw is the inverse CDF at one uniform per row (a seeded request's from its own
generator), the same distribution as the torch path's, not the same tokens.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Optional, Union

import numpy as np
import torch

from streamserve.engine.scheduler_output import TokenLogprobs
from streamserve.worker.request_state import RequestState as SamplingRow
from streamserve.worker.staging import HostStaging

LOGPROB_FLOOR = -9999.0
Stage = Callable[[np.ndarray], torch.Tensor]  # a host array -> the same on the device


@lru_cache(maxsize=None)
def _cpu_kernels():
    from streamserve.models import cpu_kernels

    return cpu_kernels.load()


class Sampler:
    """kernels: the C kernels that choose the tokens of CPU logits, None for the torch path;
    "auto": the C kernels where the device is the CPU and they build here."""

    def __init__(self, device: torch.device, seed: int, stage: Optional[Stage] = None,
                 kernels: Union[object, None, str] = "auto",
                 argmax: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        self.device = device
        self.stage = stage or HostStaging(device)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        if kernels == "auto":
            kernels = _cpu_kernels() if device.type == "cpu" else None
        self.kernels = kernels
        # logits [B, V] -> int64 [B], as torch's argmax (streamserve_kernels.sampling.argmax on
        # the GPU's Triton path); a batch of plain greedy rows takes it on the logits as they
        # come, without the cast to float32
        self.argmax = argmax or (lambda logits: logits.argmax(dim=-1))
        self.argmax_as_they_come = argmax is not None

    def column(self, values: list, dtype=np.float32) -> torch.Tensor:
        """One value per row as a [B, 1] device tensor."""
        return self.stage(np.array(values, dtype=dtype)).unsqueeze(1)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 allowed: Optional[list[Optional[np.ndarray]]] = None
                 ) -> tuple[list[int], Optional[list[Optional[TokenLogprobs]]]]:
        """allowed: per row, None or a [vocab] bool mask of the only tokens it may sample
        (structured output); applied first, as allowed_token_ids are, so its logprobs are those
        of the constrained distribution."""
        tokens, logprobs = self.sample(logits, rows, allowed)
        return tokens.tolist(), logprobs

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow],
               allowed: Optional[list[Optional[np.ndarray]]] = None
               ) -> tuple[torch.Tensor, Optional[list[Optional[TokenLogprobs]]]]:
        """As a call, with the tokens left on the device (int64 [rows]): nothing waits for
        them unless a row asks for logprobs."""
        if any(r.params.allowed_token_ids is not None for r in rows):
            allowed = [_allowed_ids_mask(r, logits.shape[1]) if r.params.allowed_token_ids is not None
                       else None if allowed is None else allowed[i] for i, r in enumerate(rows)]
        masked = allowed is not None and any(mask is not None for mask in allowed)
        reports = any(r.params.logprobs is not None for r in rows)
        bans = any(r.params.min_tokens or r.params.bad_words_token_ids for r in rows)
        biased = any(r.params.logit_bias for r in rows)
        penalised = any(r.params.has_penalties for r in rows)
        if (self.argmax_as_they_come and not (masked or reports or bans or biased or penalised)
                and all(r.params.greedy for r in rows)):
            return self.argmax(logits), None
        logits = logits.float()
        if masked:
            logits = self._keep_allowed(logits, allowed)
        # the logits the logprobs describe (the steps below make new tensors: these stay as they are)
        raw = logits if reports else None
        if bans:
            logits = self._ban(logits, rows)
        if biased:
            logits = self._add_logit_bias(logits, rows)
        if penalised:
            logits = self._penalties_in_c(logits, rows) if self._in_c(logits) else self.apply_penalties(logits, rows)
        tokens = self._choose(logits, rows)
        logprobs = None if raw is None else self.logprobs(raw, tokens, [r.params.logprobs for r in rows])
        return tokens, logprobs

    def _in_c(self, logits: torch.Tensor) -> bool:
        """Whether the C kernels take these logits (on the CPU, where they build)."""
        return self.kernels is not None and logits.device.type == "cpu"

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor,
                 counts: list[Optional[int]]) -> list[Optional[TokenLogprobs]]:
        """Per row of logits, its token's logprob and rank under log_softmax(logits), with the top
        counts[i] (None: nothing for that row): gather_logprobs, or the C kernels' (logprobs_in_c)."""
        if self._in_c(logits):
            return logprobs_in_c(self.kernels, logits, tokens, counts)
        return gather_logprobs(torch.log_softmax(logits, dim=-1), tokens, counts)

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        if self._in_c(logits):
            return self._choose_in_c(logits, rows)
        greedy = self.argmax(logits)
        if all(r.params.greedy for r in rows):
            return greedy
        temps = self.column([1.0 if r.params.greedy else r.params.temperature for r in rows])
        probs = self._filtered_probs(logits / temps, rows)
        q = torch.empty_like(probs)
        for i, r in enumerate(rows):
            if r.generator is not None:
                q[i].exponential_(generator=_seeded(r))
        if any(r.generator is None for r in rows):
            unseeded = self.column([r.generator is None for r in rows], np.bool_)
            q = torch.where(unseeded, torch.empty_like(probs).exponential_(generator=self.generator), q)
        sampled = (probs / q).argmax(dim=-1)
        is_greedy = self.column([r.params.greedy for r in rows], np.bool_).squeeze(1)
        return torch.where(is_greedy, greedy, sampled)

    def _choose_in_c(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The C kernels' choice: one uniform per row that samples, from its own generator where
        it has one (its tokens then do not depend on the batch), else from the sampler's."""
        n = len(rows)
        u = np.zeros(n, dtype=np.float32)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        unseeded = [i for i in sampled if rows[i].generator is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), generator=self.generator).numpy()
        for i in sampled:
            if rows[i].generator is not None:
                u[i] = torch.rand(1, generator=_seeded(rows[i])).item()
        params = [r.params for r in rows]
        vocab = logits.shape[1]  # a top_k past it (2^70: the API has no bound) keeps it all, as 0 does
        return self.kernels.sample(
            logits, np.array([0.0 if p.greedy else p.temperature for p in params], dtype=np.float32),
            np.array([p.min_p for p in params], dtype=np.float32),
            np.array([p.top_k if p.top_k < vocab else 0 for p in params], dtype=np.int64),
            np.array([p.top_p for p in params], dtype=np.float32), u)

    def _filtered_probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """softmax after min-p, then top-k and top-p over what min-p kept (each only if some
        row asks for it)."""
        min_p = [r.params.min_p for r in rows]
        if any(min_p):
            probs = torch.softmax(logits, dim=-1)
            threshold = self.column(min_p) * probs.amax(-1, keepdim=True)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = self._top_k_top_p(logits, top_k, top_p)
        return torch.softmax(logits, dim=-1)

    def _top_k_top_p(self, logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ks = self.column([k if 0 < k < vocab else vocab for k in top_k], np.int64)  # (any k: 2^70 too)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        drop = ranks >= ks
        ps = self.column(top_p)
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Drop a token once the mass before it already reaches top_p (the first always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= (mass_before >= ps) & (ps < 1.0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    def _entries(self, per_row: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index, token ID) device tensors for every token of every row's list."""
        lengths = [len(ids) for ids in per_row]
        rows = np.repeat(np.arange(len(per_row), dtype=np.int64), lengths)
        ids = np.fromiter((t for ids in per_row for t in ids), dtype=np.int64, count=sum(lengths))
        return self.stage(rows), self.stage(ids)

    def _keep_allowed(self, logits: torch.Tensor, allowed: list[Optional[np.ndarray]]) -> torch.Tensor:
        masked = [i for i, mask in enumerate(allowed) if mask is not None]
        index = self.stage(np.array(masked, dtype=np.int64))
        keep = self.stage(np.stack([allowed[i] for i in masked]))
        return logits.index_put((index,), logits[index].masked_fill(~keep, float("-inf")))

    def _ban(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Tokens a row may not sample now: below min_tokens, EOS and stop_token_ids; and the
        last token of any bad word whose other tokens the output ends with (vLLM's rule). A row
        they would leave nothing to sample (every token its allowed ones or its structure let
        through banned) keeps its logits: what it must say wins over what it should not."""
        index = self._entries([sorted(_banned(r)) for r in rows])
        banned = logits.index_put(index, torch.full((), float("-inf"), device=logits.device))
        emptied = (banned == float("-inf")).all(dim=-1, keepdim=True)
        return torch.where(emptied, logits, banned)

    def _add_logit_bias(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """OpenAI's logit_bias: each listed token's bias added to its logit."""
        biases = [r.params.logit_bias or {} for r in rows]
        index = self._entries([list(b) for b in biases])
        values = self.stage(np.fromiter((v for b in biases for v in b.values()), dtype=np.float32,
                                        count=sum(map(len, biases))))
        return logits.index_put(index, values, accumulate=True)

    def _penalties_in_c(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """apply_penalties through the C kernels, on a copy: a pass over each penalised row's own
        tokens (its prompt's only where it has a repetition penalty)."""
        logits = logits.contiguous().clone()
        lists, prompt_len = [], np.zeros(len(rows), dtype=np.int64)
        for i, r in enumerate(rows):
            p = r.params
            if not p.has_penalties:
                lists.append(np.empty(0, dtype=np.int64))
            elif p.repetition_penalty != 1.0:
                lists.append(np.array(r.token_ids, dtype=np.int64))
                prompt_len[i] = r.num_prompt_tokens
            else:
                lists.append(np.array(r.token_ids[r.num_prompt_tokens:], dtype=np.int64))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(ids) for ids in lists], out=offsets[1:])
        ids = np.concatenate(lists)
        params = [r.params for r in rows]
        self.kernels.apply_penalties(logits, ids, offsets, prompt_len,
                                     np.array([p.repetition_penalty for p in params], dtype=np.float32),
                                     np.array([p.frequency_penalty for p in params], dtype=np.float32),
                                     np.array([p.presence_penalty for p in params], dtype=np.float32))
        return logits

    def apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Repetition penalty over prompt and output tokens (divide positive logits,
        multiply negative ones); presence and frequency penalties over output tokens."""
        b, vocab = logits.shape
        device = logits.device
        out_index = self._entries([r.output_token_ids for r in rows])
        out_counts = torch.zeros(b, vocab, device=device).index_put_(
            out_index, torch.ones(out_index[0].shape, device=device), accumulate=True)
        prompt_index = self._entries([r.prompt_token_ids if r.params.repetition_penalty != 1.0 else []
                                      for r in rows])
        seen = torch.zeros(b, vocab, dtype=torch.bool, device=device).index_put_(
            prompt_index, torch.full((), True, device=device))
        seen |= out_counts > 0
        rep = self.column([r.params.repetition_penalty for r in rows])
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        freq = self.column([r.params.frequency_penalty for r in rows])
        pres = self.column([r.params.presence_penalty for r in rows])
        return logits - freq * out_counts - pres * (out_counts > 0).float()


def gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor,
                    counts: list[Optional[int]]) -> list[Optional[TokenLogprobs]]:
    """Per row of raw logprobs: its token's logprob and rank, with the top counts[i] (None:
    nothing for that row). -inf (a token structured output rules out) reads -9999.0, as in vLLM's API:
    JSON has no infinity."""
    chosen = raw.gather(1, tokens.unsqueeze(1))
    ranks = (raw > chosen).sum(dim=-1) + 1
    max_n = max(n or 0 for n in counts)
    top_vals, top_ids = (raw.topk(max_n, dim=-1) if max_n else (None, None))
    return _entries(chosen.squeeze(1).clamp_min(LOGPROB_FLOOR).tolist(), ranks.tolist(),
                    top_ids.tolist() if max_n else None,
                    top_vals.clamp_min(LOGPROB_FLOOR).tolist() if max_n else None, counts)


def _entries(chosen: list[float], ranks: list[int], top_ids: Optional[list[list[int]]],
             top_vals: Optional[list[list[float]]], counts: list[Optional[int]]) -> list[Optional[TokenLogprobs]]:
    """The rows' TokenLogprobs from their values as lists (None for a row whose count is None)."""
    return [None if n is None else TokenLogprobs(chosen[i], ranks[i], top_ids[i][:n] if n else [],
                                                 top_vals[i][:n] if n else [])
            for i, n in enumerate(counts)]


_MASK64 = (1 << 64) - 1


def _seeded(r: SamplingRow) -> torch.Generator:
    """A seeded row's generator, seeded for the position it samples (its token count): splitmix64's
    finalizer over the request's seed and that position, so that the draw for a request's t-th
    token is the same whatever came before it in other rows and steps. (Its high half is folded
    into the low one: the CPU's Mersenne Twister reads 32 bits of a seed.)"""
    z = (r.params.seed * 0x9E3779B97F4A7C15 + len(r.token_ids)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    r.generator.manual_seed(z ^ (z >> 32))
    return r.generator


def _banned(r: SamplingRow) -> set[int]:
    params, ids = r.params, set()
    num_output = len(r.token_ids) - r.num_prompt_tokens
    if num_output < params.min_tokens:
        ids |= params.stop_token_set
        if r.eos_token_id is not None:
            ids.add(r.eos_token_id)
    for word in params.bad_words_token_ids or ():
        before = len(word) - 1  # the tokens the output must end with for the last to complete it
        if before <= num_output and r.token_ids[len(r.token_ids) - before:] == word[:-1]:
            ids.add(word[-1])
    return ids


def _allowed_ids_mask(r: SamplingRow, vocab: int) -> np.ndarray:
    """allowed_token_ids as a [vocab] bool mask, built once per request."""
    if r.allowed_mask is None:
        r.allowed_mask = np.zeros(vocab, dtype=np.bool_)
        r.allowed_mask[r.params.allowed_token_ids] = True
    return r.allowed_mask


def logprobs_in_c(kernels, logits: torch.Tensor, tokens: torch.Tensor,
                  counts: list[Optional[int]]) -> list[Optional[TokenLogprobs]]:
    """gather_logprobs(log_softmax(logits), ...) through the C kernels (CPU logits): one exp pass and
    one comparing pass a row that asks, no [B, V] tensor of logprobs."""
    chosen, rank, top_ids, top_vals = kernels.token_logprobs(
        logits, tokens.numpy(), np.array([-1 if n is None else n for n in counts], dtype=np.int64))
    return _entries(np.maximum(chosen, LOGPROB_FLOOR).tolist(), rank.tolist(), top_ids.tolist(),
                    np.maximum(top_vals, LOGPROB_FLOOR).tolist(), counts)
