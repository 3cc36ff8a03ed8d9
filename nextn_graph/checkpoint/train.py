"""The ``tiny-trained`` preset: a tiny target trained on a synthetic corpus with
learnable structure, then a NextN head distilled on the target's own hidden
states and predictions. CPU, deterministic for a given seed and thread count,
a few minutes on 2 cores.

With a random draft acceptance is ~0 and alignment bugs hide; with this one an
off-by-one between draft rows and target hidden shows as lost acceptance.
Training runs the *cached* forward (a fresh pool per step, every sequence one
request of one prefill), so it batches many sequences in one forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..memory.batch import Chunk, ForwardBatch
from ..memory.pool import PoolLayout
from .corpus import TRAINED_PHRASES, Corpus  # noqa: F401  (Corpus: imported from here too)
from .loader import LoadedModel
from .presets import preset_config
from .save import random_models

log = logging.getLogger(__name__)

TRAINED_PRESET = "tiny-trained"


@dataclass(frozen=True)
class TrainSettings:
    seq_len: int = 64
    batch: int = 12
    target_steps: int = 350
    draft_steps: int = 250
    lr: float = 3e-3
    phrases: int = TRAINED_PHRASES


def _prefill_batch(tokens: torch.Tensor) -> ForwardBatch:
    """Every row of ``tokens`` [n, S] as one request of a single prefill."""
    return ForwardBatch.from_chunks([Chunk(i + 1, 0, row.tolist()) for i, row in enumerate(tokens)])


def _layout(tokens: torch.Tensor) -> PoolLayout:
    return PoolLayout(tokens.shape[0], tokens.shape[1], verify_width=1)


def train_target(models: LoadedModel, corpus: Corpus, st: TrainSettings) -> float:
    target = models.target
    params = [p for p in target.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=st.lr, weight_decay=0.0)
    loss = torch.tensor(0.0)
    for step in range(st.target_steps):
        tokens = corpus.batch(st.batch, st.seq_len)
        out = target(_prefill_batch(tokens), target.new_pool(_layout(tokens)))
        logits = out.logits.view(st.batch, st.seq_len, -1)[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for g in opt.param_groups:  # cosine decay
            g["lr"] = st.lr * 0.5 * (1 + torch.cos(torch.tensor(step / st.target_steps * 3.1416)).item())
        opt.step()
        if step % 50 == 0:
            log.info("target step %d loss %.3f", step, loss.item())
    return loss.item()


def train_draft(models: LoadedModel, corpus: Corpus, st: TrainSettings) -> float:
    """Distil: NextN row p sees (token p+1, target hidden p) and learns the target's
    distribution at row p+1 (its prediction of token p+2)."""
    target, draft = models.target, models.draft
    target.requires_grad_(False)
    params = list(draft.parameters())
    opt = torch.optim.AdamW(params, lr=st.lr, weight_decay=0.0)
    loss = torch.tensor(0.0)
    for step in range(st.draft_steps):
        tokens = corpus.batch(st.batch, st.seq_len)
        with torch.no_grad():
            tout = target(_prefill_batch(tokens), target.new_pool(_layout(tokens)))
        t_logits = tout.logits.view(st.batch, st.seq_len, -1)
        shifted = torch.cat((tokens[:, 1:], tokens[:, -1:]), dim=1)  # token p+1 at row p
        dout = draft(_prefill_batch(shifted), tout.hidden, draft.new_pool(_layout(tokens)))
        d_logits = dout.logits.view(st.batch, st.seq_len, -1)[:, :-1]
        vocab = d_logits.shape[-1]
        teacher = t_logits[:, 1:].reshape(-1, vocab).softmax(dim=-1)  # [n*(S-1), V]
        loss = F.kl_div(d_logits.reshape(-1, vocab).log_softmax(dim=-1), teacher,
                        reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0:
            log.info("draft step %d loss %.3f", step, loss.item())
    return loss.item()


def make_trained(seed: int = 0, settings: TrainSettings = TrainSettings()) -> LoadedModel:
    """Train and distil; bitwise reproducible for a given seed, torch build and CPU: it
    runs on one thread (multi-threaded reductions in the backward pass reorder sums)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.enable_grad():  # whatever grad mode the caller is in
            return _make_trained(seed, settings)
    finally:
        torch.set_num_threads(threads)


def _make_trained(seed: int, settings: TrainSettings) -> LoadedModel:
    torch.manual_seed(seed)
    cfg = preset_config("tiny")
    models = random_models(cfg, seed)
    corpus = Corpus(cfg.vocab_size, settings.phrases, torch.Generator().manual_seed(seed))
    train_target(models, corpus, settings)
    train_draft(models, corpus, settings)
    for m in (models.target, models.draft):
        m.eval().requires_grad_(False)
    return models
