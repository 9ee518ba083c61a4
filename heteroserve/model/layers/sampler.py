"""Turns float32 logits into next tokens: logit_bias, allowed and banned tokens, a structured output's grammar mask,
penalties, temperature, top-k/top-p/min-p, seeded draws.

Each request draws from its own `torch.Generator`, so a seeded request gives the same tokens whatever
else shares its batch. Logprobs are those of the raw model output (before any of the rules above), vLLM's
default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from heteroserve.outputs import TokenLogprobs
from heteroserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    token_ids: list[int]  # prompt followed by output so far
    num_prompt_tokens: int
    stop_ids: list[int]  # eos and stop tokens, masked while min_tokens is not reached
    generator: torch.Generator | None
    token_bitmask: torch.Tensor | None = None  # structured outputs: int32 words, bit t set = token t allowed


def logprobs_of(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Chosen-token logprob and rank plus the top-k, row by row."""
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_vals, top_ids = logprobs.topk(k, dim=1) if k else (logprobs[:, :0], token_ids[:, None][:, :0])
    return [
        TokenLogprobs(int(t), float(c), int(r), ids, vals)
        for t, c, r, ids, vals in zip(
            token_ids.tolist(),
            chosen[:, 0].tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            top_vals.tolist(),
            strict=True,
        )
    ]


def apply_token_rules(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Adds each row's logit_bias, and sets to -inf the tokens outside its allowed_token_ids and the last token
    of a bad word whose other tokens end its output (a copy; untouched when no row has such rules)."""
    bias: list[tuple[int, int, float]] = []  # (row, token, bias)
    allowed: list[tuple[int, int]] = []  # (row, token)
    banned: list[tuple[int, int]] = []  # (row, token)
    for i, row in enumerate(rows):
        p = row.params
        bias.extend((i, token, value) for token, value in (p.logit_bias or {}).items())
        allowed.extend((i, token) for token in p.allowed_token_ids or ())
        if p.bad_words_token_ids:
            output = row.token_ids[row.num_prompt_tokens :]
            for *prefix, last in p.bad_words_token_ids:
                if len(output) >= len(prefix) and output[len(output) - len(prefix) :] == prefix:
                    banned.append((i, last))
    if not (bias or allowed or banned):
        return logits
    logits = logits.clone()
    device = logits.device
    if bias:
        row_index, token_index, values = zip(*bias, strict=True)
        index = (torch.tensor(row_index, device=device), torch.tensor(token_index, device=device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)
    if allowed:
        restricted = sorted({i for i, _ in allowed})
        position = {i: k for k, i in enumerate(restricted)}
        keep = torch.zeros(len(restricted), logits.shape[-1], dtype=torch.bool, device=device)
        keep[[position[i] for i, _ in allowed], [token for _, token in allowed]] = True
        index = torch.tensor(restricted, device=device)
        logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    if banned:
        row_index, token_index = zip(*banned, strict=True)
        logits[list(row_index), list(token_index)] = float("-inf")
    return logits


class Sampler:
    def __init__(self, argmax_rows: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.argmax_rows = argmax_rows  # the platform's operator: greedy rows are a reduction over the vocabulary

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The next token of each row, and its logprobs where asked; `logits` may be changed in place."""
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_rules(logits, rows)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(random_rows) == len(rows):
            tokens = self._draw(logits, rows)
        else:
            tokens = self.argmax_rows(logits)
            if random_rows:
                index = torch.tensor(random_rows, device=logits.device)
                tokens[index] = self._draw(logits[index], [rows[i] for i in random_rows])
        return tokens.tolist(), _requested_logprobs(raw_logprobs, tokens, rows)

    def draw_with_distribution(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], torch.Tensor]:
        """A token of each (sampled) row and the distribution it was drawn from, [rows, vocab] summing to 1: a
        draft model's proposals, which speculative sampling checks against the served model's distribution."""
        probs = self._distribution(self._apply_rules(logits, rows), rows)
        probs /= probs.sum(dim=-1, keepdim=True)
        uniform = torch.cat([_uniform(r.generator) for r in rows]).to(probs.device, torch.float64)
        return _inverse_transform(probs, uniform).tolist(), probs

    def verify_drafts(
        self, logits: torch.Tensor, rows: list[SamplingRow], drafts: list[int], draft_probs: torch.Tensor | None
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Speculative sampling of one sampled request (Leviathan et al. 2023, Chen et al. 2023): `logits` and
        `rows` are its rows after its known tokens and after each of its k `drafts`; `draft_probs` [k, vocab] the
        distributions the drafts were drawn from (None: proposals that did not come from a distribution, as the
        n-gram proposer's, which are one-hot). Draft j is kept with probability min(1, p_j(x) / q_j(x)); the first
        one refused is replaced by a draw from max(0, p_j - q_j), renormalised; when all are kept a last token is
        drawn from p_k. Each token is then distributed as plain sampling's, whatever the drafts were. Returns the
        kept drafts and the new token (with logprobs where asked)."""
        raw_logprobs = torch.log_softmax(logits, dim=-1) if rows[0].params.logprobs is not None else None
        target = self._distribution(self._apply_rules(logits, rows), rows)
        target /= target.sum(dim=-1, keepdim=True)
        generator = rows[0].generator
        tokens: list[int] = []
        for j, draft in enumerate(drafts):
            q = 1.0 if draft_probs is None else float(draft_probs[j, draft])
            if float(_uniform(generator)) * q < float(target[j, draft]):
                tokens.append(draft)
                continue
            residual = target[j].clone()
            if draft_probs is None:
                residual[draft] = 0
            else:  # a draft vocabulary narrower than the model's proposes none of the tokens past it
                width = draft_probs.shape[-1]
                residual[:width] = (residual[:width] - draft_probs[j]).clamp_(min=0)
            if not residual.sum() > 0:  # p >= q everywhere: only rounding refuses a draft then
                residual = target[j]
            tokens.append(self._draw_from(residual[None], generator))
            break
        else:
            tokens.append(self._draw_from(target[len(drafts), None], generator))
        index = torch.tensor(tokens, device=logits.device)
        used = rows[: len(tokens)]
        raw = raw_logprobs[: len(tokens)] if raw_logprobs is not None else None
        return tokens, _requested_logprobs(raw, index, used)

    @staticmethod
    def _draw_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
        uniform = _uniform(generator).to(probs.device, torch.float64)
        return int(_inverse_transform(probs, uniform)[0])

    def _apply_rules(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """logit_bias, allowed and banned tokens, the grammar's mask and the penalties."""
        logits = apply_token_rules(logits, rows)
        logits = apply_token_bitmasks(logits, rows)
        return self._apply_penalties(logits, rows)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        adjusted = None
        for i, row in enumerate(rows):
            p = row.params
            num_output = len(row.token_ids) - row.num_prompt_tokens
            needs_min = num_output < p.min_tokens and row.stop_ids
            penalised = p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty
            if not (needs_min or penalised):
                continue
            if adjusted is None:
                adjusted = logits.clone()
            line = adjusted[i]
            if penalised:
                device = logits.device
                output = torch.tensor(row.token_ids[row.num_prompt_tokens :], dtype=torch.long, device=device)
                if p.repetition_penalty != 1:
                    seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long, device=device)
                    values = line[seen]
                    line[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
                if output.numel() and (p.presence_penalty or p.frequency_penalty):
                    counts = torch.bincount(output, minlength=line.numel()).to(line.dtype)
                    line -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(line.dtype)
            if needs_min:
                line[torch.tensor(row.stop_ids, dtype=torch.long, device=logits.device)] = float("-inf")
        return logits if adjusted is None else adjusted

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Draws each row's token from softmax(logits / temperature) under its filters; `logits` is changed."""
        probs = self._distribution(logits, rows)
        uniform = torch.cat([_uniform(r.generator) for r in rows]).to(probs.device, torch.float64)
        return _inverse_transform(probs, uniform)

    @staticmethod
    def _distribution(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Each row's probabilities under its temperature, top-k, top-p and min-p (min-p's cut tokens are zeroed,
        not renormalised: the draw scales by the total); `logits` is changed."""
        temperature = torch.tensor([r.params.temperature for r in rows], device=logits.device, dtype=logits.dtype)
        logits = logits.div_(temperature[:, None])
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        if any(top_k) or any(p < 1 for p in top_p):
            logits = _filter_top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        if any(min_p):
            threshold = torch.tensor(min_p, device=logits.device)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        return probs


def _requested_logprobs(
    raw_logprobs: torch.Tensor | None, tokens: torch.Tensor, rows: list[SamplingRow]
) -> list[TokenLogprobs | None]:
    """Each row's chosen-token logprob and its top `params.logprobs`, for the rows that asked (raw: the model's)."""
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    if raw_logprobs is None:
        return logprobs
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    k = max(rows[i].params.logprobs for i in wanted)
    index = torch.tensor(wanted, device=raw_logprobs.device)
    for i, entry in zip(wanted, logprobs_of(raw_logprobs[index], tokens[index], k), strict=True):
        n = rows[i].params.logprobs
        entry.top_ids, entry.top_logprobs = entry.top_ids[:n], entry.top_logprobs[:n]
        logprobs[i] = entry
    return logprobs


# Tokens per block of the two-level running sum in _inverse_transform.
SUM_BLOCK = 1024


def _inverse_transform(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """For each row, the token where the running sum of its probabilities first exceeds uniform x their total: a
    draw from the row's distribution with one uniform number (from the row's own generator). The running sum
    goes by blocks of SUM_BLOCK tokens (block totals summed in float64, then one block's tokens), so no rounding
    over a 150k vocabulary moves a token's share, and a step reads the probabilities about twice. One uniform number
    a row, not an exponential race (argmax p / E) that draws E for every token of the vocabulary (the timings are
    in bench/results/HISTORY.md)."""
    rows, vocab = probs.shape
    blocks = -(-vocab // SUM_BLOCK)
    padded = torch.nn.functional.pad(probs, (0, blocks * SUM_BLOCK - vocab)).view(rows, blocks, SUM_BLOCK)
    block_mass = padded.sum(dim=-1).double()
    running = block_mass.cumsum(dim=-1)
    target = uniform[:, None] * running[:, -1:]
    # right=True: the first block (then token) whose running sum exceeds the target, never one of probability zero
    block = torch.searchsorted(running, target, right=True).clamp_(max=blocks - 1)
    remaining = target - (running.gather(1, block) - block_mass.gather(1, block))
    inside = padded[torch.arange(rows, device=probs.device), block[:, 0]]  # [rows, SUM_BLOCK]
    position = torch.searchsorted(inside.double().cumsum(dim=-1), remaining, right=True)[:, 0]
    # rounding can leave the target at the block's very end: its last token of nonzero probability then
    last = (inside > 0).int().cumsum(dim=-1).argmax(dim=-1)
    position = torch.where(position < SUM_BLOCK, position, last).minimum(last)
    return block[:, 0] * SUM_BLOCK + position


def _uniform(generator: torch.Generator | None) -> torch.Tensor:
    if generator is None:
        return torch.rand(1)
    return torch.rand(1, generator=generator, device=generator.device)


# Row v: for each bit b of the byte v, 0.0 where it is set (the token allowed) and -inf where not.
_BYTE_BIAS = torch.where(((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def token_bitmask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] float: 0 for the tokens int32 words [rows, words] allow (bit b of word w: token 32w+b),
    -inf for the others and for tokens past the words' end (a vocabulary wider than the grammar's tokenizer).

    One row of a byte table per byte of the words, added in place: a table lookup per byte instead of a boolean
    mask of the whole vocabulary for masked_fill_ (bench/README.md, "Structured outputs", has the timings). The
    bytes are read little-endian, as every supported CPU stores them."""
    table = _BYTE_BIAS.to(bitmask.device)
    rows = bitmask.shape[0]
    bias = table.index_select(0, bitmask.contiguous().view(torch.uint8).reshape(-1).long()).reshape(rows, -1)
    if bias.shape[1] < vocab_size:
        return torch.nn.functional.pad(bias, (0, vocab_size - bias.shape[1]), value=float("-inf"))
    return bias[:, :vocab_size]


def apply_token_bitmasks(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Sets, in place, the logits of tokens a row's grammar does not allow to -inf (rows without a mask untouched)."""
    masked = [i for i, row in enumerate(rows) if row.token_bitmask is not None]
    if not masked:
        return logits
    words = torch.stack([rows[i].token_bitmask for i in masked]).to(logits.device)
    bias = token_bitmask_bias(words, logits.shape[-1]).to(logits.dtype)
    if len(masked) == len(rows):
        return logits.add_(bias)
    return logits.index_add_(0, torch.tensor(masked, device=logits.device), bias)


# Top-k / top-p look at the most likely tokens first; a full sort of the vocabulary happens only where these do
# not hold the top-p mass (a flat distribution): a top-k of the candidates costs a fraction of a full sort
# (bench/README.md, "Figures behind the code's choices").
TOP_CANDIDATES = 1024


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """-inf outside each row's top_k tokens (0: all) and, among those, outside the smallest set of most likely
    tokens whose probability (renormalised over the top_k) reaches top_p; the first token always stays."""
    vocab = logits.shape[-1]
    k = torch.tensor([min(t, vocab) if t else vocab for t in top_k], device=logits.device)
    p = torch.tensor(top_p, device=logits.device, dtype=torch.float64)
    width = min(vocab, max([TOP_CANDIDATES, *(t for t in top_k if t < vocab)]))
    values, order = logits.topk(width, dim=-1)  # descending
    drop = torch.arange(width, device=logits.device)[None, :] >= k[:, None]
    # a row's top_k all among the candidates: renormalised over them; no top_k: over the whole vocabulary
    within = k <= width
    top = values.double().masked_fill(drop, float("-inf"))
    normaliser = torch.where(within, top.logsumexp(dim=-1), logits.logsumexp(dim=-1).double())
    probs = (top - normaliser[:, None]).exp()
    mass = probs.cumsum(dim=-1)  # in float64: the cut stays where it is over thousands of small shares
    unfiltered = ~within & (p >= 1)  # neither rule applies to this row (another row of the batch has one)
    if bool((~within & ~unfiltered & (mass[:, -1] < p)).any()):  # the top-p set reaches past the candidates
        return _filter_by_full_sort(logits, k, p)
    drop |= ((mass - probs) >= p[:, None]) & (p[:, None] < 1)  # the mass strictly before the token reaches top_p
    filtered = torch.full_like(logits, float("-inf")).scatter_(1, order, values.masked_fill(drop, float("-inf")))
    return torch.where(unfiltered[:, None], logits, filtered)


def _filter_by_full_sort(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """_filter_top_k_top_p over the whole sorted vocabulary."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    positions = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = positions >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")).double(), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    drop |= (before >= p[:, None]) & (p[:, None] < 1)  # top_p 1 keeps the top_k whatever the rounding
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))
