"""What the benchmark sends: `BenchRequest`s from random token-length prompts or a JSONL file.

Random prompts are built from the served model's tokenizer when there is one (random ids of
its vocabulary, decoded, re-encoded and trimmed until the text is exactly the asked number of
tokens, as vLLM's random dataset does), else from common English words (about one token
each, so lengths are approximate and the server's usage reports the real count). Lengths are
drawn uniformly from [len * (1 - ratio), len * (1 + ratio)] per request, seeded.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tokenizers

WORDS = (
    "the of and to in is that it for was on are as with his they at be this from have or by one "
    "had not but what all were when we there can an your which their said if do will each about "
    "how up out them then she many some so these would other into has more her two like him see "
    "time could no make than first been its who now people my made over did down only way find "
    "use may water long little very after words called just where most know get through back "
    "much before go good new write our used me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take why "
    "things help put years different away again off went old number great tell men say small "
    "every found still between name should home big give air line set own under read last never "
    "us left end along while might next sound below saw something thought both few those always "
    "looked show large often together asked house world going want school important until form"
).split()
_MAX_FIT_ROUNDS = 8


class WorkloadError(ValueError):
    """A dataset or tokenizer the benchmark cannot use; the message names the file and fix."""


@dataclass(frozen=True)
class BenchRequest:
    """One request to send.

    prompt_len is the prompt's token count by the benchmark's tokenizer (None without one:
    the server's usage, when it reports it, counts instead); output_len is both `max_tokens`
    and, where the server accepts it, `min_tokens`.
    """

    prompt: str
    prompt_len: int | None
    output_len: int


def load_tokenizer(path: str | Path) -> "tokenizers.Tokenizer":
    """The fast tokenizer in `path` (a checkpoint directory with tokenizer.json, or the file)."""
    import tokenizers

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise WorkloadError(f"--tokenizer {path}: no tokenizer.json there; pass the model's checkpoint directory")
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as error:  # the Rust library raises plain Exception for a bad file
        raise WorkloadError(f"--tokenizer {file}: not a tokenizers JSON file ({error})") from None


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive (low, high) token counts for a nominal `length` (at least 1)."""
    if not 0 <= range_ratio < 1:
        raise WorkloadError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(length * (1 - range_ratio)))
    return low, max(low, math.ceil(length * (1 + range_ratio)) if range_ratio else length)


class _TokenPrompts:
    """Texts of an exact token count from random ids of a tokenizer's plain vocabulary."""

    def __init__(self, tokenizer: "tokenizers.Tokenizer") -> None:
        self.tokenizer = tokenizer
        special = {token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special}
        ids = list(range(tokenizer.get_vocab_size(with_added_tokens=False)))
        texts = tokenizer.decode_batch([[token_id] for token_id in ids], skip_special_tokens=False)
        # ids that decode to clean text on their own: no stray bytes of a multi-byte character
        self.ids = [i for i, text in zip(ids, texts) if text.strip() and "\ufffd" not in text and text not in special]
        if not self.ids:
            raise WorkloadError("the tokenizer has no plain-text tokens to build prompts from")

    def text(self, rng: random.Random, num_tokens: int) -> str:
        ids = [rng.choice(self.ids) for _ in range(num_tokens)]
        text = self.tokenizer.decode(ids)
        for _ in range(_MAX_FIT_ROUNDS):  # decoding then encoding can merge or split tokens
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            if len(ids) == num_tokens:
                break
            ids = ids[:num_tokens] + [rng.choice(self.ids) for _ in range(num_tokens - len(ids))]
            text = self.tokenizer.decode(ids)
        return text

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)


def random_requests(num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0, tokenizer: "tokenizers.Tokenizer | None" = None) -> list[BenchRequest]:
    """Seeded random prompts of about `input_len` tokens, each asking `output_len` tokens."""
    rng = random.Random(seed)
    input_range, output_range = length_range(input_len, range_ratio), length_range(output_len, range_ratio)
    prompts = _TokenPrompts(tokenizer) if tokenizer is not None else None
    requests = []
    for _ in range(num_requests):
        num_input, num_output = rng.randint(*input_range), rng.randint(*output_range)
        if prompts is None:
            requests.append(BenchRequest(" ".join(rng.choice(WORDS) for _ in range(num_input)), None, num_output))
        else:
            text = prompts.text(rng, num_input)
            requests.append(BenchRequest(text, prompts.count(text), num_output))
    return requests


def jsonl_requests(path: str | Path, num_requests: int, default_output_len: int,
                   tokenizer: "tokenizers.Tokenizer | None" = None) -> list[BenchRequest]:
    """The first `num_requests` lines of a JSONL file (`prompt`, optional `output_len`),
    repeated in order when the file has fewer."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise WorkloadError(f"--dataset-path {path}: {error.strerror or error}") from None
    entries: list[BenchRequest] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"--dataset-path {path}, line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise WorkloadError(f"{where}: not JSON ({error.msg})") from None
        prompt = item.get("prompt") if isinstance(item, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise WorkloadError(f"{where}: needs a non-empty \"prompt\" string")
        output_len = item.get("output_len", default_output_len)
        if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
            raise WorkloadError(f"{where}: \"output_len\" must be a positive integer, got {output_len!r}")
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False).ids) if tokenizer is not None else None
        entries.append(BenchRequest(prompt, prompt_len, output_len))
        if len(entries) == num_requests:
            break
    if not entries:
        raise WorkloadError(f"--dataset-path {path}: no prompts in the file")
    return [entries[index % len(entries)] for index in range(num_requests)]
