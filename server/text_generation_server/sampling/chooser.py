"""One request's token choice: logits processors, warpers and the seeded sampler.

Order (as upstream TGI): watermark -> repetition penalty -> frequency penalty -> grammar mask
-> warpers (temperature, top_k, top_p, typical_p) -> log-softmax. Sampling happens when `do_sample` is set or any
warper is active, otherwise the choice is the greedy argmax. The reported logprob comes from
the warped distribution; top-n alternatives come from the unwarped log-softmax.

Sampling is the exponential race: the token at position t (its index among the request's
prompt and generated tokens) is `argmax(p / E_t)`, where E_t is a vector of Exp(1) noise that is
a function of (seed, t) alone (`position_noise`), taken in logs: `argmax(log p + G_t)` with
G_t = -log E_t (Gumbel noise). It is an exact draw from p, and it does not
depend on what was computed before t: a seeded request gives the same tokens whatever shares
its batch and however many drafts verified mode made, and the same tokens as `off` (a draft is
kept exactly when it is the token the full model's p and E_t choose; speculative/accept.py).

Argmaxes over a vocabulary are taken with `max(-1)`: the same first maximum as `argmax`, which
torch runs several times slower on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from loguru import logger

from ..grammar import GrammarCompiler, GrammarMatcher, GrammarSpec
from ..watermark import WatermarkConfig, apply_watermark


@dataclass(frozen=True)
class SamplingParams:
    """A request's token-choice parameters (the shard's view of NextTokenChooserParameters)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    do_sample: bool = False
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        named = {"temperature": self.temperature, "top_p": self.top_p, "typical_p": self.typical_p,
                 "repetition_penalty": self.repetition_penalty, "frequency_penalty": self.frequency_penalty}
        for name, value in named.items():
            if not math.isfinite(value):  # another router may send NaN or infinity
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be strictly positive, got {self.temperature}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be strictly positive, got {self.repetition_penalty}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 < self.typical_p <= 1:
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def has_warpers(self) -> bool:
        return self.temperature != 1.0 or self.top_k != 0 or self.top_p < 1.0 or self.typical_p < 1.0

    @property
    def sampling(self) -> bool:
        return self.do_sample or self.has_warpers

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with no penalty: the batched fast path applies."""
        return not self.sampling and not self.has_penalties


def apply_penalties(logits: torch.Tensor, params: SamplingParams, token_ids: torch.Tensor) -> torch.Tensor:
    """Repetition and frequency penalties over all tokens seen so far (prompt included)."""
    if params.repetition_penalty != 1.0:
        seen = torch.unique(token_ids)
        score = logits[seen]
        logits[seen] = torch.where(score < 0, score * params.repetition_penalty, score / params.repetition_penalty)
    if params.frequency_penalty != 0.0:
        counts = torch.bincount(token_ids, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= params.frequency_penalty * counts
    return logits


def apply_warpers(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p (nucleus) and typical-p filtering of one row of logits."""
    if params.temperature != 1.0:
        logits = _scaled(logits, params.temperature)
    if params.top_k > 0:
        k = min(params.top_k, logits.shape[-1])
        threshold = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < threshold, -math.inf)
    if params.top_p < 1.0:
        logits = _top_p(logits, params.top_p)
    if params.typical_p < 1.0:
        logits = _typical_p(logits, params.typical_p)
    return logits


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits / temperature`; where that overflows (a temperature of 1e-37 is valid), the logits are
    shifted by their best first, which softmax does not see: the best words stay at 0, the others
    fall to -inf, and the row stays a distribution (the limit of temperature -> 0, greedy)."""
    scaled = logits / temperature
    if temperature < 1.0 and float(scaled.max()) == math.inf:
        scaled = (logits - logits.max()) / temperature
    return scaled


class NoTokenLeft(ValueError):
    """A request's processors left no token to choose at a position: its own error, a 422."""


def failure_message(err: Exception) -> str:
    """The message of a request that failed alone in a step (choosing, detokenizing, stopping): a
    ValueError's own words (the request's values left no choice), else a plain sentence; the
    details of a bug stay in the shard's log and never reach a client, least of all another's."""
    if isinstance(err, ValueError):
        return str(err)
    logger.opt(exception=err).error("a request failed in a step")
    return "the server failed this request in a generation step (an internal error, logged by the shard)"


_MASK64 = (1 << 64) - 1


def _position_seed(seed: int, position: int) -> int:
    """The `position`-th output of the splitmix64 stream started at `seed`: nearby seeds and
    positions give unrelated generator seeds (torch's CPU generator keeps their low 32 bits, so
    two positions of a request share their noise with a chance of about 1 in 4e9 per pair)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_noise(seed: int, position: int, size: int) -> torch.Tensor:
    """The noise `[size]` of one position of a seeded request: G = -log E, E = -log U Exp(1), U
    uniform on [0, 1) (far cheaper than `exponential_`; U = 0 gives G = -inf, a word that cannot
    win). Element i does not depend on `size`."""
    generator = torch.Generator().manual_seed(_position_seed(seed, position))
    return torch.rand(size, generator=generator).log_().neg_().log_().neg_()


def race(logprobs: torch.Tensor, noise: torch.Tensor) -> int:
    """The token `argmax(p / E)` = `argmax(log p + G)` of one position: an exact draw from
    p = exp(logprobs). In logs, without `exp`: top-p, grammars and reduced draft heads leave up to
    the whole vocabulary at -inf, and torch's `exp` of -inf is slow on the CPU."""
    return int((logprobs + noise).max(-1).indices)


LEAD_NATS = 16.0  # top-p and typical-p order the words this close to the best first (then wider, see _leading)


def _leading(key: torch.Tensor, probs: torch.Tensor, mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids of the words of highest `key` (in nats: a logit, or minus a distance in nats), in
    descending order, at least as many as it takes for their probabilities to reach `mass` (all
    words if they never do), and their cumulative probabilities. Only the words within LEAD_NATS
    of the best key are ordered (then 4x, 16x.. wider, then all, while their mass is short), found
    by one comparison: far cheaper than a `topk` or a sort over the whole vocabulary."""
    best = key.max()
    width = LEAD_NATS
    while True:
        ids = (key >= best - width).nonzero().flatten()
        ids = ids[torch.sort(key[ids], descending=True, stable=True).indices]
        cumulative = probs[ids].cumsum(-1)
        if ids.shape[-1] == key.shape[-1] or float(cumulative[-1]) >= mass:
            return ids, cumulative
        width = 4 * width if width < 1e4 else math.inf


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering (upstream's rule: remove the least likely words while their mass is at
    most 1 - top_p): a word stays while the words more likely than it hold less than `top_p`, so
    the most likely always stays, and so do the words tied with the last one kept (bf16 logits
    often tie at the cut, where a sort keeps some of a tie by position). In float64: float32
    sums of ~1e5 tiny probabilities drift."""
    probs = logits.double().softmax(-1)
    ids, cumulative = _leading(logits, probs, top_p)  # the logits order the words as their probabilities do
    kept = int(((cumulative - probs[ids]) < top_p).sum())  # a prefix: the cumulative sums only grow
    return torch.where(logits >= logits[ids[kept - 1]], logits, -math.inf)


def _typical_p(logits: torch.Tensor, typical_p: float) -> torch.Tensor:
    """Locally typical filtering (upstream's rule): order the words by how far their surprisal is
    from the entropy, find the first at which the cumulative probability reaches `typical_p`, and
    keep every word at most that far (ties included). In float64, as `_top_p`."""
    logp = logits.double().log_softmax(-1)
    entropy = -(logp.exp() * logp).nansum()
    distance = (-logp - entropy).abs()
    ids, cumulative = _leading(-distance, logp.exp(), typical_p)
    last = min(int((cumulative < typical_p).sum()), ids.shape[-1] - 1)
    return torch.where(distance <= distance[ids[last]], logits, -math.inf)


@dataclass(frozen=True)
class ChoiceContext:
    """What token choice needs from the model besides a request's parameters.

    Attributes:
        grammars: the model's grammar compiler (None: grammars are refused).
        watermark: the server's watermark strength (env WATERMARK_GAMMA / WATERMARK_DELTA).
    """

    grammars: GrammarCompiler | None = None
    watermark: WatermarkConfig = field(default_factory=WatermarkConfig)

    def matcher(self, spec: GrammarSpec | None) -> GrammarMatcher | None:
        """A fresh matcher of `spec`; a ValueError when it does not compile (the request's refusal)."""
        return None if spec is None else self._compiler(spec).matcher(spec)

    async def prepare(self, spec: GrammarSpec) -> None:
        """Compile `spec` off the step thread (GrammarCompiler.prepare); a ValueError refuses it."""
        await self._compiler(spec).prepare(spec)

    def _compiler(self, spec: GrammarSpec) -> GrammarCompiler:
        if self.grammars is None:
            raise ValueError(f"grammar ({spec.kind.value}) is not enabled on this shard")
        return self.grammars


class NextTokenChooser:
    """Chooses one request's next token from its logits (see module docstring).

    The grammar matcher (if any) advances only through `accept`, with every token the request
    keeps: a draft that verification rejects is rolled back instead (speculative/accept.py).
    """

    def __init__(self, params: SamplingParams, watermark: WatermarkConfig | None = None,
                 grammar: GrammarMatcher | None = None) -> None:
        self.params = params
        self.watermark = watermark
        self.grammar = grammar

    @property
    def warps_only(self) -> bool:
        """No processor but the warpers: a position's choice depends on its logits alone (not on
        the tokens before it, nor on which words of the vocabulary they are)."""
        return not self.params.has_penalties and self.watermark is None and self.grammar is None

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with no processor at all: the batched argmax of the fast path is this choice."""
        return not self.params.sampling and self.warps_only

    def process(self, logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Watermark, penalties, grammar mask and warpers over a copy of one row `[vocab]`."""
        logits = logits.clone()
        if self.watermark is not None:
            apply_watermark(logits, int(token_ids[-1]), self.watermark)
        logits = apply_penalties(logits, self.params, token_ids)
        if self.grammar is not None:
            self.grammar.mask_(logits)
        return apply_warpers(logits, self.params) if self.params.has_warpers else logits

    def __call__(self, logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[int, float]:
        """Choose from one row of float32 logits `[vocab]` (the grammar does not advance).

        Args:
            token_ids: all tokens of the request so far (prompt and generated), int64.
        Returns:
            (token id, logprob of that token under the warped distribution).
        """
        logprobs = self.process(logits, token_ids).log_softmax(-1)
        if not float(logprobs.max()) > -math.inf:  # all -inf, or NaN
            raise NoTokenLeft(f"no token can be chosen at position {len(token_ids)}: {self.describe()} "
                              "leave none with a finite probability")
        if self.params.sampling:
            token = race(logprobs, position_noise(self.params.seed, len(token_ids), logprobs.shape[-1]))
        else:
            token = int(logprobs.max(-1).indices)
        return token, float(logprobs[token])

    def describe(self) -> str:
        """The request's processors, for its error message."""
        p = self.params
        parts = [f"{name} {value:g}" for name, value, neutral in (
            ("temperature", p.temperature, 1.0), ("top_k", p.top_k, 0), ("top_p", p.top_p, 1.0),
            ("typical_p", p.typical_p, 1.0), ("repetition_penalty", p.repetition_penalty, 1.0),
            ("frequency_penalty", p.frequency_penalty, 0.0)) if value != neutral]
        parts += ["the grammar"] * (self.grammar is not None) + ["the watermark"] * (self.watermark is not None)
        return ", ".join(parts) or "the logits"

    def accept(self, token_id: int) -> None:
        """The request keeps `token_id`: the grammar advances over it."""
        if self.grammar is not None:
            self.grammar.accept(token_id)


FAILED_CHOICE = (0, math.nan)  # a failed row's placeholder: it keeps the batch's tensors in step, nothing reads it


def choose_tokens(last: torch.Tensor, choosers: Sequence[NextTokenChooser],
                  histories: Sequence[list[int]]) -> tuple[list[tuple[int, float]], dict[int, str]]:
    """(token, logprob) per row of `last` `[rows, vocab]`, each token kept (grammars advance), and
    the rows whose choice failed with their requests' messages (FAILED_CHOICE stands in for them).

    One batched argmax serves the plain-greedy rows (identical to their chooser's argmax, far
    cheaper than one call per row); every other row goes through its chooser (watermark,
    penalties, grammar, warpers, sampling) with `histories[row]`, its prompt and generated tokens.
    A row's failure is its own: the others are chosen as if it were not there.
    """
    plain = [row for row, c in enumerate(choosers) if c.is_plain_greedy]
    choices: dict[int, tuple[int, float]] = {}
    failures: dict[int, str] = {}
    if plain:  # no processor, so no grammar to advance
        values, ids = last[plain].log_softmax(-1).max(-1)  # over [plain rows, vocab]
        choices.update(zip(plain, zip(ids.tolist(), values.tolist(), strict=True), strict=True))
    for row, (chooser, history) in enumerate(zip(choosers, histories, strict=True)):
        if row in choices:
            continue
        try:
            choices[row] = chooser(last[row], torch.tensor(history))
            chooser.accept(choices[row][0])
        except Exception as err:  # noqa: BLE001 - one request's failure must not fail the batch
            failures[row], choices[row] = failure_message(err), FAILED_CHOICE
    return [choices[row] for row in range(len(choosers))], failures


def top_n_tokens(logprobs: torch.Tensor, n: int) -> tuple[list[int], list[float]]:
    """The n most likely tokens of one row of log-probabilities, best first.

    Ties at the n-th value are all included, so the list may be longer than n.
    """
    if n <= 0:
        return [], []
    values = torch.topk(logprobs, min(n, logprobs.shape[-1])).values
    threshold = values[-1]
    ids = torch.nonzero(logprobs >= threshold).flatten()
    ordered = ids[torch.argsort(logprobs[ids], descending=True, stable=True)]
    return ordered.tolist(), logprobs[ordered].tolist()
