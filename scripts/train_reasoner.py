"""Train the built-in reasoning model: a small Llama that adds numbers inside <think>.

Writes an HF model directory (safetensors weights, config, generation config, tokenizer with
chat template, cleave_config.json) that transformers and cleave's loader both read.

    python scripts/train_reasoner.py --out libs/cleave/assets/reasoner

Deterministic: the same command with the same library versions, on a CPU with the same
instruction set, writes a bit-identical model.safetensors (torch's CPU kernels round
differently on AVX2 and AVX512, so the record names the one used). Every random source is
seeded from `--seed` (python, numpy, torch, the problem stream, the truncation draws), torch
runs one thread and refuses nondeterministic kernels, and the thread-count variables are set
before torch starts its thread pools. The JSON printed at the end (also `--record FILE`)
names the versions, the CPU and the weights' sha256.

The sequence the model is trained on is the chat template applied to one user turn, then the
assistant reply; the loss covers only the reply and its `</s>`.

A fraction of replies (`truncated_fraction`) have their think block cut at a uniformly random
token, closed at once and followed by the true answer: `<think>{partial}</think> The answer
is {answer}.</s>`. That is what a serving engine produces when a thinking budget runs out (it
forces `</think>` and the `answer_prefix`), so the model learns to answer from partial work.
The forced `</think>` carries no loss, so the model never learns to close its thinking early.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import shlex
import string
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

# Read once, when OpenMP/MKL and cuBLAS start, i.e. at torch's first parallel or CUDA work;
# so they are set before torch is imported. Only when run as a script: importing this module
# leaves the caller's environment alone.
DETERMINISTIC_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
if __name__ == "__main__":
    os.environ.update(DETERMINISTIC_ENV)

import numpy
import safetensors
import tokenizers
import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from cleave.tasks import arithmetic

THINK_TAGS = ("<think>", "</think>")
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<think>", "</think>", "<|user|>", "<|assistant|>"]
WORD_TOKENS = ["What is", "The answer is"]
CHARACTERS = string.digits + string.ascii_letters + " \n+-*/=_?.,:;!'\"()"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|>' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
IGNORE_INDEX = -100
MAX_POSITIONS = 512


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the trained weights."""

    seed: int = 0
    steps: int = 3000
    stop_step: int | None = None
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.01
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    eval_every: int = 250  # 0: no evaluation during training
    eval_problems: int = 32
    truncated_fraction: float = 0.15


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character, plus special and word tokens."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for char in CHARACTERS:
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    # The think tags are ordinary (non-special) added tokens, so decoded text keeps them;
    # add_special_tokens would mark them special whatever their AddedToken says.
    backend.add_special_tokens([AddedToken(t, normalized=False) for t in SPECIAL_TOKENS if t not in THINK_TAGS])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in (*THINK_TAGS, *WORD_TOKENS)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def prompt_ids(tokenizer: PreTrainedTokenizerFast, problem: arithmetic.Problem) -> list[int]:
    messages = [{"role": "user", "content": arithmetic.format_prompt(problem)}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reply_tokens(
    tokenizer: PreTrainedTokenizerFast, problem: arithmetic.Problem, cut: int | None
) -> tuple[list[int], list[int]]:
    """(ids, labels) of the assistant reply ending in `</s>`.

    cut None: the full solution, every token labelled. Otherwise the think block keeps only its
    first `cut` tokens, then `</think>` (unlabelled: an engine forces it mid-thought) and
    ` The answer is {answer}.</s>`.
    """
    if cut is None:
        ids = tokenizer(arithmetic.format_solution(problem) + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        return ids, list(ids)
    opening = tokenizer(THINK_TAGS[0], add_special_tokens=False)["input_ids"]
    body = thinking_ids(tokenizer, problem)[:cut]
    closing = tokenizer(THINK_TAGS[1], add_special_tokens=False)["input_ids"]
    answer = tokenizer(f" {arithmetic.ANSWER_PREFIX} {problem.answer}.{tokenizer.eos_token}", add_special_tokens=False)
    ids = opening + body + closing + answer["input_ids"]
    labels = opening + body + [IGNORE_INDEX] * len(closing) + answer["input_ids"]
    return ids, labels


def thinking_ids(tokenizer: PreTrainedTokenizerFast, problem: arithmetic.Problem) -> list[int]:
    """Token ids strictly inside the full solution's think block (the scratchpad and its newlines)."""
    solution = arithmetic.format_solution(problem)
    inside = solution[len(THINK_TAGS[0]) : solution.index(THINK_TAGS[1])]
    return tokenizer(inside, add_special_tokens=False)["input_ids"]


def make_batch(
    tokenizer: PreTrainedTokenizerFast,
    rng: random.Random,
    batch_size: int,
    truncation_rng: random.Random,
    truncated_fraction: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels), each [B, T]; labels only on replies.

    `truncation_rng` alone decides which replies are cut and where, so the problems drawn from
    `rng` do not depend on `truncated_fraction`.
    """
    rows: list[tuple[list[int], list[int], list[int]]] = []
    for _ in range(batch_size):
        problem = arithmetic.make_problem(rng)
        cut = None
        if truncation_rng.random() < truncated_fraction:
            cut = truncation_rng.randrange(len(thinking_ids(tokenizer, problem)))  # 0 .. length - 1
        ids, labels = reply_tokens(tokenizer, problem, cut)
        rows.append((prompt_ids(tokenizer, problem), ids, labels))
    length = max(len(p) + len(r) for p, r, _ in rows)
    input_ids = torch.full((batch_size, length), tokenizer.pad_token_id)
    attention_mask = torch.zeros((batch_size, length), dtype=torch.long)
    labels = torch.full((batch_size, length), IGNORE_INDEX)
    for row, (prompt, reply, reply_labels) in enumerate(rows):
        ids = prompt + reply
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, len(prompt) : len(ids)] = torch.tensor(reply_labels)
    return input_ids, attention_mask, labels


@torch.no_grad()
def generate(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: list[arithmetic.Problem],
    temperature: float | None,
    max_new_tokens: int = 200,
) -> list[str]:
    """One completion per problem (greedy when temperature is None), special tokens kept."""
    prompts = [prompt_ids(tokenizer, p) for p in problems]
    length = max(len(p) for p in prompts)
    # Left padding so every row's next token sits in the last column.
    input_ids = torch.full((len(prompts), length), tokenizer.pad_token_id)
    attention_mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, length - len(ids) :] = torch.tensor(ids)
        attention_mask[row, length - len(ids) :] = 1
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {"do_sample": False}
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **sampling,
    )
    return [tokenizer.decode(row[length:], skip_special_tokens=False).split(tokenizer.eos_token)[0] for row in output]


def accuracy(completions: list[str], problems: list[arithmetic.Problem]) -> float:
    return sum(arithmetic.is_correct(c, p.answer) for c, p in zip(completions, problems)) / len(problems)


def learning_rate(step: int, config: TrainConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def build_model(config: TrainConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=4 * config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(model_config)


def make_deterministic(seed: int) -> None:
    """Seed every global random source and make torch run one thread and deterministic kernels.

    The problem stream and the truncation draws have their own seeded `random.Random`s; the
    global generators seeded here cover weight init and anything a library draws.
    """
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)  # CPU and every CUDA device
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already fixed once inter-op work has run in this process
        pass


def versions() -> dict[str, str]:
    """The library versions the trained weights depend on."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
    }


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def train(config: TrainConfig, snapshot_dir: Path | None = None) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    make_deterministic(config.seed)
    tokenizer = build_tokenizer()
    model = build_model(config, tokenizer)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=config.weight_decay)
    rng = random.Random(config.seed)
    truncation_rng = random.Random(f"truncate-{config.seed}")
    eval_sample = arithmetic.heldout_problems(config.eval_problems, seed=1)
    last_step = config.stop_step if config.stop_step is not None else config.steps
    start = time.time()
    for step in range(last_step):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        input_ids, attention_mask, labels = make_batch(
            tokenizer, rng, config.batch_size, truncation_rng, config.truncated_fraction
        )
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 50 == 0:
            print(f"step {step + 1} loss {loss.item():.4f} lr {learning_rate(step, config):.2e} {time.time() - start:.0f}s", flush=True)
        if config.eval_every > 0 and ((step + 1) % config.eval_every == 0 or step + 1 == last_step):
            model.eval()
            greedy = accuracy(generate(model, tokenizer, eval_sample, None), eval_sample)
            model.train()
            print(f"step {step + 1} held-out greedy accuracy {greedy:.3f}", flush=True)
            if snapshot_dir is not None:
                save(model, tokenizer, snapshot_dir / f"step{step + 1}")
    return model, tokenizer


def evaluate(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, num_problems: int, temperature: float, votes: int) -> dict:
    """Accuracy on held-out problems: greedy, and of `votes` samples at `temperature` one
    sample (mean), their majority vote and the best of them by `step_consistency`.

    Reseeds torch first, so each temperature's numbers do not depend on what ran before.
    """
    torch.manual_seed(1234)
    problems = arithmetic.heldout_problems(num_problems, seed=0)
    greedy = accuracy(generate(model, tokenizer, problems, None), problems)
    samples = [generate(model, tokenizer, problems, temperature) for _ in range(votes)]
    sampled = sum(accuracy(s, problems) for s in samples) / votes
    majority_correct = best_correct = 0
    for index, problem in enumerate(problems):
        texts = [s[index] for s in samples]
        answers = [arithmetic.extract_answer(text) for text in texts]
        counted = Counter(a for a in answers if a is not None).most_common(1)
        majority_correct += bool(counted) and counted[0][0] == problem.answer
        # The verifier sees the question, never the answer; the earliest sample wins ties.
        best = max(range(votes), key=lambda vote: arithmetic.step_consistency(texts[vote], problem.question))
        best_correct += arithmetic.is_correct(texts[best], problem.answer)
    return {
        "heldout_problems": num_problems,
        "greedy_accuracy": greedy,
        "temperature": temperature,
        "sampled_accuracy": sampled,
        f"majority_at_{votes}_accuracy": majority_correct / num_problems,
        f"best_of_{votes}_step_consistency_accuracy": best_correct / num_problems,
    }


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # Older transformers read the template only from tokenizer_config.json.
    tokenizer_config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # a name every transformers knows
    tokenizer_config["model_max_length"] = MAX_POSITIONS
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    cleave_config = {"reasoning": {"start_tag": "<think>", "end_tag": "</think>", "starts_in_reasoning": False,
                                   "answer_prefix": " The answer is"}}
    (out / "cleave_config.json").write_text(json.dumps(cleave_config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("libs/cleave/assets/reasoner"))
    parser.add_argument("--steps", type=int, default=TrainConfig.steps, help="length of the LR schedule")
    parser.add_argument("--stop-step", type=int, default=None, help="stop early, keeping the --steps schedule")
    parser.add_argument("--snapshot-dir", type=Path, default=None, help="also save the model at every evaluation")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--truncated-fraction", type=float, default=TrainConfig.truncated_fraction,
                        help="share of replies whose think block is cut short before the answer")
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--hidden-size", type=int, default=TrainConfig.hidden_size)
    parser.add_argument("--num-layers", type=int, default=TrainConfig.num_layers)
    parser.add_argument("--eval-every", type=int, default=TrainConfig.eval_every,
                        help="steps between held-out checks while training (0: none)")
    parser.add_argument("--eval-problems", type=int, default=200, help="final evaluation's problems (0: skip it)")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--votes", type=int, default=8)
    parser.add_argument("--record", type=Path, default=None, help="also write the final JSON record to this file")
    args = parser.parse_args(argv)
    config = TrainConfig(
        seed=args.seed, steps=args.steps, stop_step=args.stop_step, truncated_fraction=args.truncated_fraction,
        batch_size=args.batch_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
        eval_every=args.eval_every,
    )
    start = time.time()
    model, tokenizer = train(config, args.snapshot_dir)
    train_seconds = time.time() - start
    print(f"trained in {train_seconds:.0f}s", flush=True)
    save(model, tokenizer, args.out)
    record = {
        "command": shlex.join(["python", *sys.argv]) if argv is None else shlex.join(["python", __file__, *argv]),
        "config": asdict(config),
        "versions": versions(),
        "torch_threads": torch.get_num_threads(),
        # CPU kernels round differently per instruction set: bit-identical needs the same one.
        "cpu": {"machine": platform.machine(), "capability": torch.backends.cpu.get_cpu_capability()},
        "train_seconds": round(train_seconds, 1),
        "model_sha256": file_sha256(args.out / "model.safetensors"),
    }
    if args.eval_problems > 0:
        model.eval()
        record["evaluation"] = evaluate(model, tokenizer, args.eval_problems, args.temperature, args.votes)
    text = json.dumps(record, indent=2)
    if args.record is not None:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
