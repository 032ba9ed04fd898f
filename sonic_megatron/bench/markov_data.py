"""A learnable synthetic corpus for ``bench e2e --data markov``: token sequences of a fixed random Markov chain,
written as a Megatron indexed dataset (``.bin`` / ``.idx``) that ``pretrain_gpt.py`` reads with ``--data-path``.

Why: Megatron's ``--mock-data`` documents count upwards (token i+1 follows token i), so every model drives its
loss to ~0 within a few hundred iterations, where no comparison of two loss curves says anything. Here every
token has ``successors`` possible next tokens drawn once from the vocabulary, with fixed probabilities (halving:
8/15, 4/15, 2/15, 1/15 for four): the best possible loss is the chain's entropy rate (1.14 nats for four), and
a model reaches it only by learning a vocab x successors table: at ``bench e2e``'s configs the loss after 200
iterations still lies ~0.5 nats above it, so it ranks how well a model trains.

The chain is a function of (vocab, successors, seed) alone, and the documents of (docs, doc_len) too: every
provider of a run, and every run with the same arguments, trains on the same tokens. Held-out documents for
validation (``valid_docs``) are other walks of the same chain, from a random stream of their own: asking for them
leaves the training documents as they are.
"""

from __future__ import annotations

import os

import numpy as np


def successor_probs(successors: int) -> np.ndarray:
    """probs_S [successors]: each successor half as likely as the one before, normalised."""
    probs_S = 0.5 ** np.arange(successors)
    return probs_S / probs_S.sum()


def transition_table(vocab: int, successors: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(next_VS [vocab, successors] token ids, probs_S [successors]) of the chain."""
    if vocab < 2 or not 1 <= successors <= vocab:
        raise ValueError(f"markov data: need vocab >= 2 and 1 <= successors <= vocab, got {vocab}, {successors}")
    rng = np.random.default_rng(seed)
    next_VS = rng.integers(0, vocab, size=(vocab, successors), dtype=np.int64)
    return next_VS, successor_probs(successors)


def entropy_rate(successors: int) -> float:
    """The chain's entropy per token in nats (the loss floor of a perfect model; repeated successor ids,
    rare at a large vocabulary, only lower it)."""
    p = successor_probs(successors)
    return float(-(p * np.log(p)).sum())


def generate(vocab: int, successors: int, docs: int, doc_len: int, seed: int, *, held_out: bool = False) -> np.ndarray:
    """Token ids [docs, doc_len] (int32): ``docs`` independent walks of the chain from uniform starts; with
    ``held_out`` other walks of the same chain (an independent random stream: validation documents that no
    training document repeats by construction, and training documents that do not depend on them)."""
    next_VS, probs_S = transition_table(vocab, successors, seed)
    rng = np.random.default_rng([seed, 1] if held_out else seed + 1)
    out = np.empty((docs, doc_len), dtype=np.int32)
    out[:, 0] = rng.integers(0, vocab, size=docs)
    choice_DL = rng.choice(successors, size=(docs, doc_len), p=probs_S)
    for i in range(1, doc_len):
        out[:, i] = next_VS[out[:, i - 1], choice_DL[:, i]]
    return out


def write_dataset(
    prefix: str, *, vocab: int, successors: int, docs: int, doc_len: int, seed: int, valid_docs: int = 0
) -> str:
    """Write ``prefix``.bin / ``prefix``.idx (Megatron's indexed dataset, one document per walk: the ``docs``
    training walks, then ``valid_docs`` held-out ones, ``generate(..., held_out=True)``) unless both exist;
    returns ``prefix`` (the ``--data-path`` value). ``--split docs,valid_docs,0`` gives Megatron exactly these
    two parts."""
    if os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx"):
        return prefix
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    parts = [generate(vocab, successors, docs, doc_len, seed)]
    if valid_docs:
        parts.append(generate(vocab, successors, valid_docs, doc_len, seed, held_out=True))
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=np.int32)
    for row in np.concatenate(parts):
        builder.add_document(torch.from_numpy(row), [doc_len])
    builder.finalize(tmp + ".idx")
    # Renamed into place only when complete: an interrupted write never passes for a dataset.
    os.replace(tmp + ".bin", prefix + ".bin")
    os.replace(tmp + ".idx", prefix + ".idx")
    return prefix
