"""`shardwise predict --run DIR`: what the encoders do with a trained run (one process, from a
checkpoint of any layout).

  bert  fills each <mask> of --text: the top --top-k tokens per mask, with their probabilities
  t5    fills each <extra_id_N> span of --text: the greedy decoding of the spans, as T5 was trained
  vit   classifies the run's held-out images (data.val_fraction of its data.source; all images
        when it held none out): the accuracy, and the first --show predictions

The decoders (llama, gpt2) generate instead: `shardwise generate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import re

import torch

from shardwise.data.images import load_images, split_images
from shardwise.data.objectives import MASK_TOKEN, mask_id
from shardwise.data.tokenizer import eos_id
from shardwise.infer.load import load_run


@dataclass
class MaskFill:
    position: int
    candidates: list[tuple[str, float]]
    """(token text, probability), most likely first."""


def encode_with_masks(tokenizer, text: str) -> list[int]:
    """The ids of `text` with each literal MASK_TOKEN as the mask id (the tokenizer encodes a
    special token's spelling inside text as ordinary text, so the pieces are encoded apart)."""
    pieces = text.split(MASK_TOKEN)
    ids: list[int] = []
    for index, piece in enumerate(pieces):
        if index:
            ids.append(mask_id(tokenizer))
        if piece:
            ids.extend(tokenizer.encode(piece).ids)
    return ids


@torch.no_grad()
def fill_masks(model, tokenizer, text: str, top_k: int = 5) -> list[MaskFill]:
    if MASK_TOKEN not in text:
        raise ValueError(f"--text {text!r} has no {MASK_TOKEN}: write {MASK_TOKEN} where a token should be filled in")
    ids = encode_with_masks(tokenizer, text)
    if len(ids) > model.cfg.max_seq_len:
        raise ValueError(f"--text is {len(ids)} tokens, longer than model.max_seq_len ({model.cfg.max_seq_len}); "
                         "shorten it")
    logits = model(torch.tensor([ids]))[0]
    masked = [i for i, token in enumerate(ids) if token == mask_id(tokenizer)]
    fills = []
    for position in masked:
        probs = logits[position].float().softmax(-1)
        top = probs.topk(min(top_k, probs.numel()))
        fills.append(MaskFill(position, [(tokenizer.decode([int(i)]), float(p)) for p, i in zip(top.values, top.indices)]))
    return fills


SENTINEL = re.compile(r"(<extra_id_\d+>)")


def encode_with_sentinels(tokenizer, text: str) -> list[int]:
    """The ids of `text` with each literal <extra_id_N> as its sentinel token (the tokenizer encodes a
    special token's spelling inside text as ordinary text, so the pieces are encoded apart)."""
    ids: list[int] = []
    for piece in SENTINEL.split(text):
        sentinel = tokenizer.token_to_id(piece) if SENTINEL.fullmatch(piece) else None
        if SENTINEL.fullmatch(piece) and sentinel is None:
            raise ValueError(f"--text names {piece}, which the run's tokenizer does not have; use <extra_id_0> ...")
        ids.extend([sentinel] if sentinel is not None else tokenizer.encode(piece).ids if piece else [])
    return ids


@torch.no_grad()
def fill_spans(model, tokenizer, text: str, max_new_tokens: int = 32) -> str:
    """T5's greedy decoding of `text`'s corrupted spans: each sentinel followed by what it hid."""
    if not SENTINEL.search(text):
        raise ValueError(f"--text {text!r} has no <extra_id_0>: write <extra_id_0>, <extra_id_1>, ... where spans "
                         "should be filled in")
    ids = encode_with_sentinels(tokenizer, text) + [eos_id(tokenizer)]
    out = model.greedy_generate(torch.tensor([ids]), max_new_tokens, eos_id=eos_id(tokenizer))[0, 1:].tolist()
    if eos_id(tokenizer) in out:
        out = out[:out.index(eos_id(tokenizer))]
    return tokenizer.decode(out, skip_special_tokens=False)


@dataclass
class Classification:
    accuracy: float
    labels: list[int]
    predictions: list[int]
    split: str


@torch.no_grad()
def classify_held_out(model, cfg, batch_size: int = 256) -> Classification:
    images = load_images(cfg.data.source.strip(), cfg.data.image_pad)
    _, held_out = split_images(images, cfg.data.val_fraction)
    split = "held-out" if held_out is not None else "all (the run held none out)"
    data = held_out or images
    predictions = []
    for start in range(0, data.num_images, batch_size):
        batch = torch.from_numpy(data.images[start:start + batch_size])
        predictions.extend(model(batch).argmax(-1).tolist())
    labels = data.labels.tolist()
    correct = sum(p == y for p, y in zip(predictions, labels))
    return Classification(accuracy=correct / len(labels), labels=labels, predictions=predictions, split=split)


def predict_text(args) -> str:
    """What `shardwise predict` prints."""
    cfg, model, tokenizer = load_run(Path(args.run), checkpoint=args.checkpoint and Path(args.checkpoint))
    family = cfg.model.family
    if family == "bert":
        if not args.text:
            raise ValueError(f'--text is required for a BERT run: e.g. --text "def {MASK_TOKEN}(self):"')
        lines = []
        for number, fill in enumerate(fill_masks(model, tokenizer, args.text, args.top_k), start=1):
            shown = "  ".join(f"{token!r} {prob:.1%}" for token, prob in fill.candidates)
            lines.append(f"mask {number} (token {fill.position}): {shown}")
        return "\n".join(lines)
    if family == "t5":
        if not args.text:
            raise ValueError('--text is required for a T5 run: e.g. --text "def <extra_id_0>(self):"')
        return fill_spans(model, tokenizer, args.text, args.max_new_tokens)
    if family == "vit":
        result = classify_held_out(model, cfg)
        pairs = ", ".join(f"{y}->{p}" for y, p in list(zip(result.labels, result.predictions))[:args.show])
        return (f"{cfg.data.source} images, {result.split}: {len(result.labels)} classified, accuracy "
                f"{result.accuracy:.1%}\nfirst {min(args.show, len(result.labels))} (label->prediction): {pairs}")
    raise ValueError(f"--run {args.run!r} is a {family} run, which generates text: use `shardwise generate --run "
                     f"{args.run}`")
