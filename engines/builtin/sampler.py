"""The next token of each request from the step's logits, its log-probability (see
engines/interface.py for the one definition), and whether the request is finished."""

from __future__ import annotations

import torch

from engines.builtin.penalties import apply_penalties, min_p_mask
from engines.builtin.sample_kernels import sample_pairs, seeded_gumbel_argmax, seeded_uniform
from engines.builtin.sequence import Sequence
from engines.builtin.transfer import to_device
from engines.interface import SamplingParams
from engines.kernels.paged_attention import triton_usable


def greedy_pairs(logits: torch.Tensor) -> torch.Tensor:
    """[B, 2] float64: each row's argmax (the first of equal ones) and its log-probability:
    the greedy rule, by :func:`sample_pairs` where Triton runs (so the decode graph's picker,
    engines/builtin/model_runner.py, and an eager step agree exactly), else by torch."""
    if triton_usable(logits.device):
        return sample_pairs(logits)
    logits = logits.float()
    tok = logits.argmax(dim=-1)  # (one read of the logits more, no [B, V] log-softmax written)
    lp = logits.gather(1, tok[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    return torch.stack((tok.double(), lp.double()), dim=1)


class Sampled:
    """One step's tokens [B] and their log-probs, on the device and on their way to the host
    (into a pinned buffer, the copy's completion marked by an event): :meth:`read` waits for
    that step's work only, not for work queued after it. ``pairs`` [B, 2] float64: (token,
    log-prob) of each row; ``tok``: the tokens on the device (float64 when from ``pairs``)."""

    def __init__(self, pairs: torch.Tensor, pinned: torch.Tensor | None, tok: torch.Tensor | None = None):
        self.tok = pairs[:, 0] if tok is None else tok
        self.event = None
        if pinned is None:
            self.host = pairs
        else:
            # a contiguous view: a copy into a strided host tensor goes through a pageable
            # temporary, which makes the device->host copy wait for all queued work
            self.host = pinned[: pairs.numel()].view(pairs.shape)
            self.host.copy_(pairs, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self) -> tuple[list[int], list[float]]:
        if self.event is not None:
            self.event.synchronize()
        return self.host[:, 0].long().tolist(), self.host[:, 1].tolist()  # (column by column: ~3x faster)


class Sampler:
    def __init__(self, tokenizer, eos: set):
        self.tokenizer = tokenizer
        self.eos = eos  # the engine's set: shared, not copied
        self._pinned: list[torch.Tensor] = []  # two host buffers, used in turn (CUDA)
        self._turn = 0

    @staticmethod
    def on_device(sampling: SamplingParams) -> bool:
        """Whether a row is sampled without the host's help (:meth:`sample_batch` waits on
        nothing): greedy, or drawn from the whole (min_p-masked) distribution; not penalized
        (penalties count the tokens the host has seen), not truncated by top-k / top-p (drawn
        row by row)."""
        return not sampling.penalized and (
            sampling.temperature == 0 or (sampling.top_k < 0 and sampling.top_p >= 1.0))

    @staticmethod
    def all_greedy(seqs: list[Sequence]) -> bool:
        """Whether every row takes its argmax as is (greedy, unpenalized): what a decode
        graph can pick itself (``ModelRunner.decode(greedy=True)``)."""
        return all(s.sampling.temperature == 0 and not s.sampling.penalized for s in seqs)

    def sample_batch(self, logits: torch.Tensor, seqs: list[Sequence], ahead: int = 0,
                     picked: torch.Tensor | None = None) -> Sampled:
        """Sample one token per row on the device; the result's :meth:`Sampled.read` gives
        them (one device->host transfer for the batch). Seeded rows use Gumbel-max over
        :func:`seeded_uniform` noise (batched) at position ``len(output) + ahead`` (``ahead``:
        tokens of the request sampled but not yet appended); rows that truncate by top-k /
        top-p are handled row by row (min_p alone is batched: a mask). Penalties change the
        rows that ask for them first (:mod:`.penalties`). ``picked``: the rows' greedy
        (token, log-prob) pairs, already computed (when :meth:`all_greedy`). Where Triton
        runs, the :meth:`one_pass` rows take :func:`sample_pairs` (whatever the other rows:
        a row's result does not depend on the batch)."""
        pinned = self._pinned_buffer(logits.device, len(seqs))
        if picked is not None:
            return Sampled(picked, pinned)
        one = [i for i, s in enumerate(seqs) if self.one_pass(s.sampling)] if triton_usable(logits.device) else []
        plain = [i for i in one if not seqs[i].sampling.penalized]
        if len(plain) == len(seqs):  # the kernel reads the logits in the model's dtype (a decode graph's)
            return Sampled(self._pick(logits, seqs, ahead), pinned)
        # Every other row reads float32 logits, penalties applied. A row's result must not depend
        # on its neighbours: an unpenalized one-pass row reads the model's logits whatever the
        # batch (the kernel compiled for float32 input may round its log-sum-exp differently).
        full = apply_penalties(logits.float(), seqs, self.eos)
        if not one:
            return Sampled(self._torch_pairs(full, seqs, ahead), pinned)
        pairs = torch.empty((len(seqs), 2), dtype=torch.float64, device=logits.device)
        penalized = [i for i in one if seqs[i].sampling.penalized]
        rest = sorted(set(range(len(seqs))) - set(one))
        for rows, source, pick in ((plain, logits, self._pick), (penalized, full, self._pick),
                                   (rest, full, self._torch_pairs)):
            if rows:
                idx = to_device(rows, logits.device, torch.int64)
                pairs[idx] = pick(source[idx], [seqs[i] for i in rows], ahead)
        return Sampled(pairs, pinned)

    def _torch_pairs(self, logits: torch.Tensor, seqs: list[Sequence], ahead: int) -> torch.Tensor:
        """[B, 2] float64 (token, log-prob) by torch operations (every device)."""
        if all(s.sampling.temperature == 0 for s in seqs):  # (greedy rows take one_pass where Triton runs)
            return greedy_pairs(logits)
        tok, logp = self._sample_rows(logits, seqs, ahead)
        lp = logp.gather(1, tok[:, None])[:, 0]
        return torch.stack((tok.double(), lp.double()), dim=1)

    @staticmethod
    def one_pass(sampling: SamplingParams) -> bool:
        """Whether a row's token and log-prob come from :func:`sample_pairs` (Triton): greedy,
        or drawn from the whole distribution at its temperature (no top-k, top-p, min_p)."""
        return sampling.temperature == 0 or (sampling.top_k < 0 and sampling.top_p >= 1.0 and sampling.min_p <= 0)

    @staticmethod
    def _pick(logits: torch.Tensor, seqs: list[Sequence], ahead: int) -> torch.Tensor:
        """[B, 2] (token, log-prob) by :func:`sample_pairs`: a seeded row draws with the noise
        of (its seed, its position), as :func:`seeded_gumbel_argmax`; an unseeded one with a
        fresh seed from torch's generator."""
        if all(s.sampling.temperature == 0 for s in seqs):
            return greedy_pairs(logits)
        seeded = [s.generator is not None for s in seqs]
        fresh = torch.randint(0, 1 << 62, (len(seqs),), dtype=torch.int64).tolist() if not all(seeded) else []
        # (built as lists: a tensor written element by element costs ~10 us a write, ms a step)
        seeds = [s.sampling.seed if k else fresh[i] for i, (s, k) in enumerate(zip(seqs, seeded))]
        positions = [len(s.output) + ahead if k else -1 for s, k in zip(seqs, seeded)]  # -1: Philox noise
        dev = logits.device
        temps = to_device([float(s.sampling.temperature) for s in seqs], dev, torch.float32)
        keys = to_device([seeds, positions], dev, torch.int64)
        return sample_pairs(logits, temps, keys[0], keys[1])

    def _pinned_buffer(self, device: torch.device, rows: int) -> torch.Tensor | None:
        """The next of two pinned buffers of at least 2 x ``rows`` float64: a step's buffer is
        read before the step two later writes it (the engine lands a step before launching the
        one after next)."""
        if device.type != "cuda":
            return None
        if not self._pinned or self._pinned[0].numel() < 2 * rows:
            size = 2 * max(rows, 256)
            self._pinned = [torch.empty(size, dtype=torch.float64, pin_memory=True) for _ in range(2)]
        self._turn ^= 1
        return self._pinned[self._turn]

    def _sample_rows(self, logits: torch.Tensor, seqs: list[Sequence],
                     ahead: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B] and the log-softmax at each row's temperature [B, V]."""
        dev = logits.device
        temps = to_device([s.sampling.temperature or 1.0 for s in seqs], dev, logits.dtype)
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)
        tok = logits.argmax(dim=-1)  # greedy rows; every other row is drawn below
        drop = min_p_mask(logp, seqs)  # min_p: tokens no row may draw
        draw_logp = logp if drop is None else logp.masked_fill(drop, float("-inf"))
        draw_logits = logits if drop is None else logits.masked_fill(drop, float("-inf"))
        untruncated = [i for i, s in enumerate(seqs)
                       if s.sampling.temperature > 0 and s.sampling.top_k < 0 and s.sampling.top_p >= 1.0]
        plain = [i for i in untruncated if seqs[i].generator is None]
        seeded = [i for i in untruncated if seqs[i].generator is not None]
        if plain:
            if len(plain) == len(seqs):
                tok = torch.multinomial(draw_logp.exp(), 1)[:, 0]
            else:
                idx = to_device(plain, dev, torch.int64)
                tok[idx] = torch.multinomial(draw_logp[idx].exp(), 1)[:, 0]
        if seeded:  # Gumbel-max with noise from (seed, position): batched and batch-independent
            idx = to_device(seeded, dev, torch.int64)
            seeds = to_device([seqs[i].sampling.seed for i in seeded], dev, torch.int64)
            pos = to_device([len(seqs[i].output) + ahead for i in seeded], dev, torch.int64)
            rows, row_temps = draw_logits[idx], temps[idx]
            if triton_usable(dev):  # one fused pass over the vocabulary per row
                tok[idx] = seeded_gumbel_argmax(rows, row_temps, seeds, pos)
            else:
                u = seeded_uniform(seeds, pos, logits.shape[-1])
                tok[idx] = ((rows / row_temps[:, None]).double() - torch.log(-torch.log(u))).argmax(dim=-1)
        batched = set(plain) | set(seeded)
        for i, s in enumerate(seqs):
            if s.sampling.temperature > 0 and i not in batched:
                tok[i] = self._sample(logits[i], s.sampling, s.generator)[0]
        return tok, logp

    @staticmethod
    def _sample(logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator | None) -> tuple[int, float]:
        """One row: greedy, or drawn after top-k / top-p / min-p truncation (with ``gen`` if
        seeded; min_p keeps tokens at least ``min_p`` times as likely as the most likely)."""
        if sampling.temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)
            tok = int(torch.argmax(logits))
            return tok, float(logp[tok])
        logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
        probs = logp.exp()
        if sampling.top_k > 0 and sampling.top_k < probs.numel():
            kth = torch.topk(probs, sampling.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if sampling.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < sampling.top_p
            keep[0] = True  # the most likely token always stays (a top_p below float32's range reads as 0)
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[idx[keep]] = True
            probs = torch.where(mask, probs, torch.zeros_like(probs))
        if sampling.min_p > 0:  # the most likely token survives top-k / top-p: its probability is the max
            probs = torch.where(probs >= probs.max() * sampling.min_p, probs, torch.zeros_like(probs))
        tok = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
        return tok, float(logp[tok])

    def is_finished(self, seq: Sequence, tok: int) -> bool:
        """Whether ``tok`` (just appended) ends ``seq``: eos (unless ignored), a stop token
        id, a stop string, or the length limit. Sets its finish reason (and, for a stop
        string or token, the text: as SGLang, the stop string and all after it, or the stop
        token, are left out of it unless ``no_stop_trim``)."""
        sampling = seq.sampling
        skip = sampling.skip_special_tokens
        if (not sampling.ignore_eos and tok in self.eos) or tok in sampling.stop_token_ids:
            seq.finish_reason = "stop"
            if not sampling.no_stop_trim:
                seq.text_before_stop = self.tokenizer.decode(seq.output[:-1], skip_special_tokens=skip)
            return True
        if sampling.stop:
            # A stop string completed by this token lies within the last few tokens (a token
            # is at least one byte; a character at most 4): decode only that tail each step,
            # and the whole output once one matches (to cut at its first occurrence).
            window = 4 * max(len(s) for s in sampling.stop) + 4
            tail = self.tokenizer.decode(seq.output[-window:], skip_special_tokens=skip)
            if any(s and s in tail for s in sampling.stop):
                text = self.tokenizer.decode(seq.output, skip_special_tokens=skip)
                hits = [text.find(s) for s in sampling.stop if s and s in text]
                if hits:
                    seq.finish_reason = "stop"
                    seq.text_before_stop = text if sampling.no_stop_trim else text[: min(hits)]
                    return True
        if len(seq.output) >= sampling.max_new_tokens:
            seq.finish_reason = "length"
            return True
        return False
