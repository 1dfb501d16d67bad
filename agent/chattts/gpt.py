"""Continuous batching over ChatTTS's GPT: rows join, leave, park and resume between steps.

ChatTTS's own ``GPT.generate`` runs one fixed batch to the end. Here every row (one utterance)
owns its sampling state, and the batch is a single left-padded KV cache of the real
``LlamaModel`` that ChatTTS loaded (``chat.gpt.gpt``), with ChatTTS's own embedding and code
heads (``chat.embed``). Each ``step()`` feeds every active row its last sampled token in one
batched forward pass and samples the next one.

Layout invariant: a row of length ``n`` occupies the last ``n`` slots of the cache; slots to its
left are padding and masked out. So joining a row is one left-pad and concatenation, leaving
is one index-select, and the mask is rebuilt from lengths.

The batch cache lives in preallocated buffers that grow geometrically (``_GrowLayer``): a step
writes one slot per layer instead of re-concatenating the whole cache as transformers'
DynamicCache (and therefore ChatTTS) does every token.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from agent.chattts.decode import SAMPLES_PER_TOKEN

KV = list[tuple[torch.Tensor, torch.Tensor]]

log = logging.getLogger(__name__)

_SECONDS_PER_TOKEN = SAMPLES_PER_TOKEN / 24_000  # ChatTTS's output rate


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.3
    top_p: float = 0.7
    top_k: int = 20
    repetition_penalty: float = 1.05
    max_new_tokens: int = 2048


@dataclass(eq=False)
class Row:
    """One utterance's generation state. Owned by the worker thread."""

    emb: torch.Tensor  # (1, P, H) prompt embedding, consumed by prefill
    sampling: Sampling
    generator: torch.Generator
    processors: tuple[Any, ...]
    next_ids: torch.Tensor | None = None  # (num_vq,) sampled, not yet fed to the model
    length: int = 0  # positions in this row's KV cache
    tokens: list[torch.Tensor] = field(default_factory=list)  # (num_vq,) each
    hiddens: list[torch.Tensor] = field(default_factory=list)  # (H,) each, decoder input
    finished: bool = False
    parked_kv: KV | None = None
    text_chars: int = 0  # of the text it speaks, for the log
    # The session it speaks for, for the log: the worker thread has no session context
    # ("speech cut off" named no session, found by review).
    session_id: str | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.hiddens)


class BatchedGPT:
    """Batched token loop over a loaded ``ChatTTS.Chat``. Not thread-safe: one worker owns it."""

    def __init__(self, chat: Any) -> None:
        from ChatTTS.model import gen_logits

        self._gen_logits = gen_logits
        self.chat = chat
        self.llama = chat.gpt.gpt
        self.embed = chat.embed
        self.device = torch.device(chat.device_gpt)
        self.out_device = torch.device(chat.device)
        self.dtype = self.llama.dtype
        self.num_vq = int(chat.config.gpt.num_vq)
        self.eos = int(chat.config.gpt.num_audio_tokens) - 1
        self.rows: list[Row] = []  # active rows, in cache batch order
        self._cache: Cache | None = None
        self._head_weights: list[torch.Tensor] | None = None
        self.steps = 0

    # -- building rows -------------------------------------------------------------------
    @torch.inference_mode()
    def make_row(
        self,
        text: str,
        *,
        prompt: str,
        spk_emb: torch.Tensor | None,
        sampling: Sampling,
        seed: int,
    ) -> Row:
        """Tokenize and embed one utterance the way ChatTTS's ``_infer_code`` does."""
        chat = self.chat
        texts = chat.speaker.decorate_code_prompts(
            [text], prompt, None, "" if spk_emb is not None else None
        )
        input_ids, _attn, text_mask = chat.tokenizer.encode(texts, self.num_vq, device=self.device)
        emb = self.embed(input_ids, text_mask)
        if spk_emb is not None:
            chat.speaker.apply(emb, spk_emb, input_ids, chat.tokenizer.spk_emb_ids, self.device)
        warpers, processors = self._gen_logits(
            num_code=self.eos,
            top_P=sampling.top_p,
            top_K=sampling.top_k,
            repetition_penalty=sampling.repetition_penalty,
        )
        gen = torch.Generator(device=self.out_device).manual_seed(seed)
        return Row(
            emb=emb,
            sampling=sampling,
            generator=gen,
            processors=(*processors, *warpers),
            text_chars=len(text),
        )

    # -- sampling ------------------------------------------------------------------------
    def _heads(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, H) -> (B, num_vq, num_audio_tokens) float logits, like ChatTTS's code heads."""
        if self._head_weights is None:
            import torch.nn.utils.parametrize as P

            # The heads are weight-normed: their weights are recomputed from (g, v) on every
            # call. They never change, so compute them once.
            with P.cached():
                self._head_weights = [h.weight.detach().clone() for h in self.embed.head_code]
        logits = [torch.nn.functional.linear(hidden, w) for w in self._head_weights]
        return torch.stack(logits, 1).float()

    def _sample(self, row: Row, logits: torch.Tensor) -> torch.Tensor:
        """One row's (num_vq, V) logits -> (num_vq,) ids, with ChatTTS's processors.

        Each row samples with its own generator: seeded output does not depend on which other
        rows share the batch (up to float rounding of batched kernels)."""
        s = row.sampling
        logits = logits / s.temperature
        past = (
            torch.stack(row.tokens[-16:], 1).to(logits.device)
            if row.tokens
            else torch.zeros(self.num_vq, 0, dtype=torch.long, device=logits.device)
        )
        for proc in row.processors:
            logits = proc(past, logits)
        probs = torch.softmax(logits, -1)
        return torch.multinomial(probs, 1, generator=row.generator).view(self.num_vq)

    def _accept(self, row: Row, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        ids = self._sample(row, logits)
        ended = bool(ids.eq(self.eos).any())
        if ended or row.n_tokens >= row.sampling.max_new_tokens:
            if not ended:
                # Cut off mid-speech, with no error for anyone to see: say so. The engine
                # plans generations well within the cap (agent/chattts/engine.py).
                log.warning(
                    "speech cut off at max_new_tokens=%d (%.1f s of audio): the rest of a "
                    "%d-character text is not spoken",
                    row.sampling.max_new_tokens,
                    row.n_tokens * _SECONDS_PER_TOKEN,
                    row.text_chars,
                    extra={"session_id": row.session_id or "-"},
                )
            row.finished = True
            row.next_ids = None
            return
        row.tokens.append(ids)
        row.hiddens.append(hidden)
        row.next_ids = ids

    # -- cache management ----------------------------------------------------------------
    def _mask(self, lengths: Sequence[int], total: int) -> torch.Tensor:
        """Additive (B, 1, 1, total) mask: each row sees only its own last ``length`` slots."""
        pos = torch.arange(total, device=self.device)
        starts = torch.tensor([total - n for n in lengths], device=self.device)
        visible = pos.unsqueeze(0) >= starts.unsqueeze(1)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return mask[:, None, None, :]

    @property
    def _kv(self) -> KV:
        return _kv_of(self._cache) if self._cache is not None else []

    def _set_kv(self, kv: KV) -> None:
        self._cache = Cache(layers=[_GrowLayer(k, v) for k, v in kv]) if kv else None

    @property
    def width(self) -> int:
        kv = self._kv
        return int(kv[0][0].shape[2]) if kv else 0

    def _join(self, row: Row, kv: KV) -> None:
        """Append a row (its own unpadded cache ``kv``) to the batch."""
        n = row.length
        width = max(self.width, n)
        merged: KV = []
        batch = self._kv
        for li, (k, v) in enumerate(kv):
            k = _left_pad(k, width)
            v = _left_pad(v, width)
            if batch:
                bk, bv = batch[li]
                k = torch.cat([_left_pad(bk, width), k], 0)
                v = torch.cat([_left_pad(bv, width), v], 0)
            merged.append((k, v))
        self._set_kv(merged)
        self.rows.append(row)

    def _drop(self, indices: Sequence[int]) -> None:
        gone = set(indices)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self._set_kv([])
            return
        idx = torch.tensor(keep, device=self.device)
        # Leading slots that are padding for every remaining row can go.
        trim = self.width - max(r.length for r in self.rows)
        self._set_kv(
            [
                (k.index_select(0, idx)[:, :, trim:], v.index_select(0, idx)[:, :, trim:])
                for k, v in self._kv
            ]
        )

    @torch.inference_mode()
    def add(self, row: Row) -> None:
        """Prefill a new row (or resume a parked one) and make it part of the batch."""
        if row.parked_kv is not None:
            kv, row.parked_kv = row.parked_kv, None
            self._join(row, kv)
            return
        emb = row.emb.to(self.device, self.dtype)
        p = emb.shape[1]
        cache = DynamicCache()
        out = self.llama(
            inputs_embeds=emb,
            position_ids=torch.arange(p, device=self.device).unsqueeze(0),
            cache=cache,
            use_cache=True,
        )
        # clone: a view would keep the whole prompt's hidden states alive with the row
        hidden = out.last_hidden_state[:, -1].to(self.out_device, torch.float).clone()
        row.length = p
        kv = _kv_of(cache)
        self._accept(row, hidden[0], self._heads(hidden)[0])
        if not row.finished:
            self._join(row, kv)

    def park(self, row: Row) -> None:
        """Take a row out of the batch, keeping its cache, so it costs nothing until resumed."""
        i = self.rows.index(row)
        start = self.width - row.length
        row.parked_kv = [
            (k[i : i + 1, :, start:].clone(), v[i : i + 1, :, start:].clone()) for k, v in self._kv
        ]
        self._drop([i])

    def remove(self, row: Row) -> None:
        if row in self.rows:
            self._drop([self.rows.index(row)])
        row.parked_kv = None

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """Feed every active row its pending token; returns the rows that finished."""
        if not self.rows:
            return []
        ids = torch.stack([r.next_ids for r in self.rows if r.next_ids is not None]).to(self.device)
        emb = sum(self.embed.emb_code[q](ids[:, q]) for q in range(self.num_vq))
        assert isinstance(emb, torch.Tensor)
        emb = emb.unsqueeze(1).to(self.dtype)
        lengths = [r.length + 1 for r in self.rows]
        width = self.width + 1
        cache = self._cache
        out = self.llama(
            inputs_embeds=emb,
            attention_mask=self._mask(lengths, width),
            position_ids=torch.tensor([[r.length] for r in self.rows], device=self.device),
            cache=cache,
            use_cache=True,
        )
        hidden = out.last_hidden_state[:, -1].to(self.out_device, torch.float)
        logits = self._heads(hidden)
        done: list[int] = []
        for i, row in enumerate(self.rows):
            row.length += 1
            # clone: a view of this step's (B, H) output kept every batch-mate's hidden
            # state alive with the row, B times its own (found by review)
            self._accept(row, hidden[i].clone(), logits[i])
            if row.finished:
                done.append(i)
        finished = [self.rows[i] for i in done]
        if done:
            self._drop(done)
        self.steps += 1
        return finished


class _GrowLayer(DynamicLayer):
    """A KV layer in a buffer with spare capacity: appending writes in place (amortised O(1))."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self._n = int(keys.shape[2])
        self._k = _with_capacity(keys, self._n + 64)
        self._v = _with_capacity(values, self._n + 64)
        self.device = keys.device
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self._k[:, :, : self._n]
        self.values = self._v[:, :, : self._n]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(key_states.shape[2])
        if self._n + n > self._k.shape[2]:
            cap = 2 * (self._n + n)
            self._k = _with_capacity(self._k[:, :, : self._n], cap)
            self._v = _with_capacity(self._v[:, :, : self._n], cap)
        self._k[:, :, self._n : self._n + n] = key_states
        self._v[:, :, self._n : self._n + n] = value_states
        self._n += n
        self._views()
        return self._k[:, :, : self._n], self._v[:, :, : self._n]


def _with_capacity(t: torch.Tensor, cap: int) -> torch.Tensor:
    buf = torch.empty(t.shape[0], t.shape[1], cap, t.shape[3], dtype=t.dtype, device=t.device)
    buf[:, :, : t.shape[2]] = t
    return buf


def _kv_of(cache: Cache) -> KV:
    """The per-layer (keys, values) tensors of a DynamicCache, (B, heads, T, head_dim) each."""
    out: KV = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)
        out.append((keys, values))
    return out


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - t.shape[2]
    if extra <= 0:
        return t
    pad = torch.zeros(t.shape[0], t.shape[1], extra, t.shape[3], dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], 2)
