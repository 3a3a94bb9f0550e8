#!/usr/bin/env python3
"""Write a local GSM8K-shaped lm_eval task: seeded word problems, jsonl files and a task YAML.

Every prompt is the same N-shot prefix (sampler first_n) plus one question, so all
requests share a long prefix - the case prefix caching and KV offloading serve.

    python e2e/make_task.py [--out DIR] [--num-test 32] [--num-fewshot 8]
"""

import argparse
import json
import random
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "build" / "e2e-task"
TASK = "tiny_gsm"
NAMES = ["Tom", "Ada", "Lin", "Sara", "Omar", "Mia", "Ravi", "Noor", "Ken", "Lea"]
ITEMS = ["apples", "pencils", "stamps", "marbles", "books", "coins", "cards", "shells"]
SEED = 1234


def problem(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 40), rng.randint(2, 30), rng.randint(2, 9)
    kind = rng.randrange(3)
    if kind == 0:
        q = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?"
        ans = a + b
        sol = f"{name} has {a} + {b} = {ans} {item}."
    elif kind == 1:
        big = a + b
        q = f"{name} had {big} {item} and gave away {b}. How many {item} are left?"
        ans = a
        sol = f"{name} has {big} - {b} = {ans} {item} left."
    else:
        q = f"{name} packs {c} boxes with {a} {item} each. How many {item} are packed?"
        ans = a * c
        sol = f"{name} packs {c} * {a} = {ans} {item}."
    return {"question": q, "answer": f"{sol}\n#### {ans}"}


def corpus_text(num: int = 2000) -> list[str]:
    """Text the local tokenizer is trained on (same generator as the task)."""
    rng = random.Random(SEED + 1)
    out = []
    for _ in range(num):
        p = problem(rng)
        out.append(f"Question: {p['question']}\nAnswer: {p['answer']}\n\n")
    return out


YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    train: {train}
    test: {test}
output_type: generate_until
training_split: train
fewshot_split: train
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
fewshot_delimiter: "\\n\\n"
num_fewshot: {shots}
fewshot_config:
  sampler: first_n
generation_kwargs:
  until: ["\\n\\n", "Question:"]
  do_sample: false
  temperature: 0.0
  max_gen_toks: {max_gen}
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_task(out: Path, num_test: int, num_fewshot: int, max_gen: int = 16) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    train = [problem(rng) for _ in range(max(num_fewshot, 8) + 8)]
    test = [problem(rng) for _ in range(num_test)]
    for name, rows in (("train", train), ("test", test)):
        with open(out / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    (out / f"{TASK}.yaml").write_text(YAML.format(
        task=TASK, train=out / "train.jsonl", test=out / "test.jsonl",
        shots=num_fewshot, max_gen=max_gen))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--num-test", type=int, default=32)
    ap.add_argument("--num-fewshot", type=int, default=8)
    ap.add_argument("--max-gen-toks", type=int, default=16)
    a = ap.parse_args()
    out = write_task(a.out, a.num_test, a.num_fewshot, a.max_gen_toks)
    print(f"wrote task {TASK!r} ({a.num_test} test docs, {a.num_fewshot}-shot) to {out}")


if __name__ == "__main__":
    main()
