"""Training an EAGLE-3 head on the CPU in seconds to minutes, for tests and the speculative
benchmark: a benchmark fixture, not a product trainer.

The head (``pagedserve.tools.eagle3_head.Eagle3Reference``) learns the target's own greedy
predictions (distillation): at root ``i``, step ``s`` predicts the target's argmax at
``i + s``, from the target's features of ``i`` and the tokens ``t_{i+1} .. t_{i+s}``, its
later steps reading its own outputs as drafting does (EAGLE-3's training-time test). It
starts from the target's embeddings (frozen, not saved: the executor shares them) and LM
head, deterministic from a seed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.common.trained import _tokenizer_ids, copy_corpus, ordinary_vocab, read_marker
from pagedserve.tools.eagle3_head import Eagle3Reference, head_config, save_head, target_features

__all__ = ["train_eagle3_head", "write_eagle3_fixture", "write_workload_head"]

MARKER = "eagle3_fixture.json"  # written last: the head's settings and scores
#: The fixture head's training: corpus sequences, their length, and train_eagle3_head's.
FIXTURE: dict[str, int] = {"num_sequences": 512, "length": 127, "steps": 300, "depth": 3}


def train_eagle3_head(
    target_dir: Path,
    out_dir: Path,
    sequences: Sequence[Sequence[int]],
    *,
    steps: int = 200,
    depth: int = 3,
    lr: float = 3e-3,
    batch_size: int = 32,
    seed: int = 0,
) -> dict[str, float]:
    """Train a head for the checkpoint at ``target_dir`` on ``sequences`` (token ids, each of
    more than ``depth`` tokens) and write it to ``out_dir``; returns the training's scores:
    seconds, and step 1's accuracy against the target's argmax before and after."""
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    target = AutoModelForCausalLM.from_pretrained(
        str(target_dir), dtype=torch.float32, local_files_only=True
    ).eval()
    config = head_config(json.loads((Path(target_dir) / "config.json").read_text()))
    head = Eagle3Reference(config)
    aux = tuple(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    length = max(len(s) for s in sequences)
    num_roots = length - depth
    tokens = torch.zeros(len(sequences), length, dtype=torch.int64)  # [N, L], zero-padded
    features = torch.zeros(len(sequences), num_roots, 3 * config["target_hidden_size"])
    labels = torch.full((len(sequences), length), -100)  # the target's next token; -100: none
    with torch.no_grad():
        for n, seq in enumerate(sequences):
            ids = torch.tensor([list(seq)])
            tokens[n, : len(seq)] = ids[0]
            features[n, : len(seq) - depth] = target_features(target, ids, aux)[
                0, : len(seq) - depth
            ]
            labels[n, : len(seq)] = target(ids).logits.argmax(-1)[0]
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight)
    head.embed_tokens.weight.requires_grad_(False)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)

    def accuracy() -> float:
        with torch.no_grad():
            logits = head(tokens, features, depth=1)[0][0]
            want = labels[:, 1 : num_roots + 1]
            right = (logits.argmax(-1) == want) & (want >= 0)
            return float(right.sum() / (want >= 0).sum())

    initial = accuracy()
    for _ in range(steps):
        batch = torch.randperm(len(tokens), generator=gen)[:batch_size]
        outs = head(tokens[batch], features[batch], depth=depth)
        loss = sum(
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), labels[batch, s : s + num_roots].flatten()
            )
            for s, (logits, _) in enumerate(outs, start=1)
        )
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    scores = {
        "train_seconds": time.perf_counter() - t0,
        "initial_accuracy": initial,
        "accuracy": accuracy(),
    }
    save_head(head, Path(out_dir), with_embed=False)
    return scores


def _cached(directory: Path, settings: dict[str, object]) -> bool:
    marker = directory / MARKER
    return marker.is_file() and json.loads(marker.read_text()).get("settings") == settings


def write_workload_head(
    directory: Path, target: Path, prompts: list[list[int]], max_tokens: int, seed: int = 0
) -> Path:
    """``directory``: a head trained on ``target``'s own greedy outputs for ``prompts`` (of
    one length), ``max_tokens`` each: a head that has seen the workload it drafts for, whose
    drafts are nearly all accepted. It measures the machinery's ceiling (what a well-trained
    head would give), not a head's quality. Cached like :func:`write_eagle3_fixture`."""
    directory = Path(directory)
    settings = {"prompts": prompts, "max_tokens": max_tokens, "seed": seed, "target": target.name}
    settings["trained"] = read_marker(target)  # a head is retrained when its target is
    if _cached(directory, settings):
        return directory
    model = AutoModelForCausalLM.from_pretrained(
        str(target), dtype=torch.float32, local_files_only=True
    ).eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False
        )
    scores = train_eagle3_head(target, directory, out.tolist(), steps=300, depth=3, seed=seed)
    marker = {"settings": settings, "scores": scores}
    (directory / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return directory


def write_eagle3_fixture(directory: Path, target: Path, seed: int = 0) -> Path:
    """``directory``: an EAGLE-3 head for the speculative benchmark's fixture ``target``,
    trained on the copy corpus the target learnt from (another draw of it). Cached: a head
    whose marker records this target (its training record too), seed and :data:`FIXTURE` is
    kept."""
    directory = Path(directory)
    settings = {**FIXTURE, "seed": seed, "target": target.name, "trained": read_marker(target)}
    if _cached(directory, settings):
        return directory
    bos = _tokenizer_ids()[1]
    corpus = copy_corpus(seed + 7, FIXTURE["num_sequences"], FIXTURE["length"], ordinary_vocab())
    scores = train_eagle3_head(
        target,
        directory,
        [[bos, *s] for s in corpus],
        steps=FIXTURE["steps"],
        depth=FIXTURE["depth"],
        seed=seed,
    )
    marker = {"settings": settings, "scores": scores}
    (directory / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return directory
