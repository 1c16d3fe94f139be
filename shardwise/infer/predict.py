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
from shardwise.data.spelled_specials import SENTINEL, EncoderInputTokenizer, encode_with_specials
from shardwise.data.tokenizer import eos_id
from shardwise.generation.engine import engine_for_model, generate_all
from shardwise.generation.sampling import SamplingParams
from shardwise.infer.load import load_run
from shardwise.models.families import spec_of

MASK_PATTERN = re.compile(f"({re.escape(MASK_TOKEN)})")


@dataclass
class MaskFill:
    position: int
    candidates: list[tuple[str, float]]
    """(token text, probability), most likely first."""


def fill_masks(model, tokenizer, text: str, top_k: int = 5) -> list[MaskFill]:
    if MASK_TOKEN not in text:
        raise ValueError(f"--text {text!r} has no {MASK_TOKEN}: write {MASK_TOKEN} where a token should be filled in")
    mask = mask_id(tokenizer)
    ids = encode_with_specials(tokenizer, text, MASK_PATTERN, lambda spelling: mask)
    if len(ids) > model.cfg.max_seq_len:
        raise ValueError(f"--text is {len(ids)} tokens, longer than model.max_seq_len ({model.cfg.max_seq_len}); "
                         "shorten it")
    logits = model(torch.tensor([ids]))[0]
    masked = [i for i, token in enumerate(ids) if token == mask]
    fills = []
    for position in masked:
        probs = logits[position].float().softmax(-1)
        top = probs.topk(min(top_k, probs.numel()))
        fills.append(MaskFill(position, [(tokenizer.decode([int(i)]), float(p)) for p, i in zip(top.values, top.indices)]))
    return fills


def fill_spans(model, tokenizer, text: str, max_new_tokens: int = 32) -> str:
    """T5's greedy decoding of `text`'s corrupted spans: each sentinel followed by what it hid
    (through the engine, as `shardwise generate` and `serve` decode)."""
    if not SENTINEL.search(text):
        raise ValueError(f"--text {text!r} has no <extra_id_0>: write <extra_id_0>, <extra_id_1>, ... where spans "
                         "should be filled in")
    eos = eos_id(tokenizer)
    spans = EncoderInputTokenizer(tokenizer, eos)
    engine = engine_for_model(model, spans, eos_id=eos, max_batch=1)
    greedy = SamplingParams(max_tokens=max_new_tokens, temperature=0)
    return generate_all(engine, [spans.encode(text).ids], greedy)[0].text


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
    data = held_out if held_out is not None else images
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
    spec = spec_of(cfg.model.family)
    if spec.objective == "masked_lm":
        if not args.text:
            raise ValueError(f'--text is required for a BERT run: e.g. --text "def {MASK_TOKEN}(self):"')
        lines = []
        for number, fill in enumerate(fill_masks(model, tokenizer, args.text, args.top_k), start=1):
            shown = "  ".join(f"{token!r} {prob:.1%}" for token, prob in fill.candidates)
            lines.append(f"mask {number} (token {fill.position}): {shown}")
        return "\n".join(lines)
    if spec.objective == "span_corruption":
        if not args.text:
            raise ValueError('--text is required for a T5 run: e.g. --text "def <extra_id_0>(self):"')
        return fill_spans(model, tokenizer, args.text, args.max_new_tokens)
    if spec.objective == "image_classification":
        result = classify_held_out(model, cfg)
        pairs = ", ".join(f"{y}->{p}" for y, p in list(zip(result.labels, result.predictions))[:args.show])
        return (f"{cfg.data.source} images, {result.split}: {len(result.labels)} classified, accuracy "
                f"{result.accuracy:.1%}\nfirst {min(args.show, len(result.labels))} (label->prediction): {pairs}")
    raise ValueError(f"--run {args.run!r} is a {spec.name} run, which generates text: use `shardwise generate --run "
                     f"{args.run}`")
