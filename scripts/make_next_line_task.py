"""Write a multiple-choice task of next lines, a JSONL of {"context", "choices", "label"} items for --eval and
scripts/eval.py, from the validation text of the trainer's data: each item's context is a few lines of that
text, and its four choices are the line that follows them and three lines drawn (seeded) from elsewhere in it.

    python3 scripts/make_next_line_task.py --out next_line.jsonl                   # 1000 items
    python3 scripts/make_next_line_task.py --val-shard VAL.bin --tokenizer tokenizer.model --items 500

The validation text is the validation shard, decoded, that train_llama.py reads when given no data arguments:
the starter pack's tinyshakespeare (its first 32,768 tokens) when it was downloaded, else the built-in corpus
(every 50th source file of this Python's standard library), so a model trained that way never trains on the
items. Answers and distractors are lines of at least 8 characters (blank lines only stand in contexts); a
distractor is never a line near the answer nor the same text. The context ends with its last line's newline,
which lm-eval's rules move into the continuation: each choice is scored as the text "\\n " + line.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from llama.runtime.cli import ArgumentParser, positive_int
from llama.data.shards import ShardError, open_shard
from llama.data.tokenizer import TokenizerError, load_tokenizer
from llama.run.trainer import UserError, resolve_data

CHOICES = 4
MIN_CHARS = 8  # an answer's or a distractor's length without its surrounding spaces


def validation_text(shard: str | Path, tokenizer) -> str:
    """The shard's documents decoded one after the other (without their <|begin_of_text|> tokens)."""
    tokens = open_shard(shard, tokenizer.vocab_size)
    return tokenizer.decode(tokens[tokens != tokenizer.bos_id])


def distractors(lines: list[str], candidates: np.ndarray, answer: int, near: int, rng) -> list[str]:
    """CHOICES - 1 lines of the candidates (seeded), none within `near` lines of the answer's, none the answer's
    text, no two the same."""
    picked, texts = [], {lines[answer].strip()}
    for j in rng.permutation(candidates):
        if abs(int(j) - answer) > near and lines[j].strip() not in texts:
            picked.append(lines[j])
            texts.add(lines[j].strip())
            if len(picked) == CHOICES - 1:
                return picked
    raise ValueError(f"the text has too few distinct lines of {MIN_CHARS}+ characters for {CHOICES} choices")


def next_line_items(text: str, count: int, context_lines: int, seed: int) -> list[dict]:
    """Up to `count` items of the text's lines, in the text's order: the context_lines lines before an answer (and
    the newline after them), the answer among CHOICES choices at a seeded position."""
    lines = text.split("\n")
    candidates = np.array([i for i, line in enumerate(lines) if len(line.strip()) >= MIN_CHARS], dtype=np.int64)
    answerable = [int(i) for i in candidates if i >= context_lines and "".join(lines[i - context_lines:i]).strip()]
    rng = np.random.default_rng(seed)
    chosen = sorted(rng.choice(answerable, size=min(count, len(answerable)), replace=False)) if answerable else []
    items = []
    for i in chosen:
        choices = distractors(lines, candidates, i, context_lines, rng)
        label = int(rng.integers(CHOICES))
        choices.insert(label, lines[i])
        items.append({"context": "\n".join(lines[i - context_lines:i]) + "\n", "choices": choices, "label": label})
    return items


def the_val_shard(args, tokenizer) -> str:
    """--val-shard, else the validation shard the trainer reads with no data arguments."""
    if args.val_shard:
        return args.val_shard
    _, val = resolve_data(argparse.Namespace(train_data=None, val_data=None), tokenizer)
    return val


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="next_line.jsonl", help="the task file to write (default: next_line.jsonl)")
    p.add_argument("--val-shard", default=None, help="a validation shard (default: the trainer's, see above)")
    p.add_argument("--tokenizer", default=None, help="the shard's tokenizer.model or tokenizer.json (default: the "
                   "trainer's, tokenizer/tokenizer.model in the per-user cache, else bytes)")
    p.add_argument("--items", type=positive_int, default=1000, help="how many items (default: 1000)")
    p.add_argument("--context-lines", type=positive_int, default=4, help="lines of context (default: 4)")
    p.add_argument("--seed", type=int, default=0, help="the draws' seed (default: 0)")
    args = p.parse_args(argv)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        shard = the_val_shard(args, tokenizer)
        text = validation_text(shard, tokenizer)
        items = next_line_items(text, args.items, args.context_lines, args.seed)
        if not items:
            raise ValueError(f"{shard} has no line of {MIN_CHARS}+ characters after {args.context_lines} others")
        Path(args.out).write_text("".join(json.dumps(item) + "\n" for item in items))
    except (OSError, ValueError, ShardError, TokenizerError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(items)} items ({args.context_lines} lines of context, {CHOICES} choices) from the "
          f"{text.count(chr(10)) + 1} lines of {shard} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
