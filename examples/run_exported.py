"""Greedy generation from a `shardwise export` directory, with torch and tokenizers alone (no shardwise).

    python examples/run_exported.py DIR --prompt 'def ' [--prompt 'import '] [--max-new-tokens 64] [--json]

Every prompt runs in one batch: prompts are left-padded to one length (`pad` tells the programs
how many columns of each row carry no token), prefill returns each row's next-token logits and its
keys and values, and each decode step takes the whole cache and returns one more column of it,
which is appended here. A row ends at the end-of-text token (kept in its token ids, not in its
text), after --max-new-tokens, or when prompt and answer fill the model's max_seq_len, as
`shardwise generate --temperature 0` ends it. The rows share one cache length, so generation
stops for all once the longest prompt's row fills max_seq_len.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch._inductor.package import load_package


def load(export_dir: Path):
    manifest = json.loads((export_dir / "manifest.json").read_text())
    tokenizer = Tokenizer.from_file(str(export_dir / manifest["tokenizer"]))
    tokenizer.encode_special_tokens = manifest["encode_special_tokens"]
    package = str(export_dir / manifest["package"])
    return manifest, tokenizer, load_package(package, "prefill"), load_package(package, "decode")


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, S] (padding: token 0, which the programs hide) and pad [B]."""
    width = max(len(ids) for ids in prompts)
    tokens = torch.tensor([[0] * (width - len(ids)) + ids for ids in prompts])
    return tokens, torch.tensor([width - len(ids) for ids in prompts])


@torch.no_grad()
def generate(manifest: dict, prefill, decode, prompts: list[list[int]], max_new_tokens: int):
    """Each prompt's greedy token ids (the end-of-text token included where it ended one)."""
    tokens, pad = left_padded(prompts)
    logits, keys, values = prefill(tokens, pad)
    outputs = [[] for _ in prompts]
    done = [False] * len(prompts)
    while True:
        chosen = logits.argmax(dim=-1)
        for row, token in enumerate(chosen.tolist()):
            if done[row]:
                continue
            outputs[row].append(token)
            done[row] = (token == manifest["eos_id"] or len(outputs[row]) >= max_new_tokens
                         or len(prompts[row]) + len(outputs[row]) >= manifest["max_seq_len"])
        if all(done) or keys.shape[3] >= manifest["max_seq_len"]:
            return outputs
        logits, new_keys, new_values = decode(chosen[:, None].contiguous(), pad, keys, values)
        keys, values = torch.cat([keys, new_keys], dim=3), torch.cat([values, new_values], dim=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export_dir", type=Path, help="a directory written by `shardwise export`")
    parser.add_argument("--prompt", action="append", help="a prompt to continue (repeat for a batch)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt: completion, token ids")
    args = parser.parse_args()
    manifest, tokenizer, prefill, decode = load(args.export_dir)
    prompts = args.prompt or ["def "]
    ids = [tokenizer.encode(prompt).ids for prompt in prompts]
    started = time.perf_counter()
    outputs = generate(manifest, prefill, decode, ids, args.max_new_tokens)
    seconds = time.perf_counter() - started
    for prompt, output in zip(prompts, outputs):
        text = tokenizer.decode([t for t in output if t != manifest["eos_id"]])
        if args.json:
            print(json.dumps({"prompt": prompt, "completion": text, "token_ids": output}, ensure_ascii=False))
        else:
            print(prompt + text + "\n")
    if not args.json:
        count = sum(len(output) for output in outputs)
        print(f"[{count} tokens in {seconds:.2f} s, {len(prompts)} prompts in one batch]")


if __name__ == "__main__":
    main()
