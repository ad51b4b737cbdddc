"""Business eval sets for the real model (`models/smollm2-135m`): a retail shop's customer messages.

    python -m pipelines.demo.real_sets            (re)writes eval_sets/retail_*/ (fixed seed: byte-identical):
                                                  the task YAML, data.jsonl (scored) and calibration.jsonl
                                                  (held-out items for `--calibration from-eval-sets`)
    python -m pipelines.demo.real_sets --check    exit 1 if the files on disk differ from what it generates

Every item is drawn from templates with one seeded random generator per set, so the sets are
reproducible and no item repeats. They are sized for a 135M-parameter instruct model scored by
lm-eval through vLLM's completions endpoint (raw text, no chat template): well above chance, far from
100%, prompts well under 200 tokens. Measured scores are in docs/real-model.md.

| set | type | what |
| --- | --- | --- |
| retail_sentiment | multiple choice (acc) | a short product review -> positive / negative / neutral |
| retail_faulty_item | multiple choice (acc) | a complaint naming two products -> which of four products is faulty |
| retail_order_id | generative (exact_match) | a customer message -> the order number in it (one worked example in the prompt) |
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipelines.paths import EVAL_SETS_DIR

PREFIX = "retail_"
ITEMS = 240
HELD_OUT = 64  # calibration.jsonl: held-out items for `--calibration from-eval-sets`, never scored
SEED = 20261201

FIRST = ["Anna", "Ben", "Carla", "David", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kim", "Lena", "Marco",
         "Nora", "Omar", "Paula", "Rosa", "Sam", "Tariq", "Ute", "Vera", "Yusuf", "Zoe", "Leo"]
LAST = ["Berg", "Costa", "Dietz", "Evans", "Fischer", "Garcia", "Hansen", "Ito", "Jensen", "Klein", "Lopez", "Meyer",
        "Novak", "Olsen", "Petrov", "Quinn", "Rossi", "Schmidt", "Tanaka", "Weber"]
PRODUCTS = ["blender", "kettle", "desk lamp", "backpack", "phone case", "headset", "coffee maker", "yoga mat",
            "water bottle", "toaster", "office chair", "rain jacket", "shoe rack", "frying pan", "vacuum cleaner",
            "alarm clock", "hair dryer", "bluetooth speaker", "electric toothbrush", "garden hose", "winter coat",
            "laptop stand", "duvet", "smart watch"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]


@dataclass(frozen=True)
class RealSet:
    name: str
    make_item: Callable[[random.Random], dict]
    key: str  # the field that makes an item unique
    yaml: str


# ---------------------------------------------------------------- retail_sentiment

POSITIVE = [
    "Works perfectly and looks great.", "Absolutely love it, best purchase this year.", "Great quality for the price.",
    "Arrived early and works like a charm.", "Very happy with it, would buy again.", "Excellent, exactly as described.",
    "Sturdy, well made and easy to use.", "My kids love it. Five stars.", "Brilliant, I use it every day.",
    "Fantastic value, highly recommended.", "Even better than I expected.", "Lovely design and it feels solid.",
]
NEGATIVE = [
    "Broke after two days.", "Terrible quality, do not buy.", "Stopped working after a week, very disappointed.",
    "Arrived damaged and support never answered.", "Cheap plastic, it cracked on the first use.", "Waste of money.",
    "Much smaller than the photos, returning it.", "It leaks everywhere. Awful.", "Loud, slow and already scratched.",
    "The worst purchase I have made in years.", "Does not work at all, I want a refund.", "Fell apart in a month.",
]
NEUTRAL = [
    "It does the job, nothing special.", "Arrived on Tuesday. Have not tried it yet.",
    "Average product, about what you would expect.", "It is fine. Not great, not bad.", "Okay for the price, I guess.",
    "Looks like the picture. Time will tell.", "Some things are good, some are not.", "Does what it says, no more.",
    "Bought it as a gift, so I cannot say much.", "Standard quality, same as the one I had before.",
    "Delivery took five days, as announced.", "Neither impressed nor disappointed.",
]
SENTIMENTS = ["positive", "negative", "neutral"]


def task_yaml(name: str, output_type: str, body: str, metric: str, about: str) -> str:
    """An lm-eval task over the set's own data.jsonl: what every set shares, around what is its own."""
    return (
        f"task: {name}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        "    test: data.jsonl\n"
        "# data_files relative to this folder wherever lm-eval runs (lm-eval 0.4.13 reads them from the working directory)\n"
        "custom_dataset: !function pipelines.evaluation.evalsets.set_data\n"
        "test_split: test\n"
        f"output_type: {output_type}\n"
        f"{body}"
        "metric_list:\n"
        f"- metric: {metric}\n"
        "  aggregation: mean\n"
        "  higher_is_better: true\n"
        "metadata:\n"
        "  version: 1.0\n"
        f"  about: {about}\n"
    )


def sentiment_item(rng: random.Random) -> dict:
    label = rng.randrange(3)
    product = rng.choice(PRODUCTS)
    body = rng.choice((POSITIVE, NEGATIVE, NEUTRAL)[label])
    review = rng.choice([f"The {product}: {body}", f"{body}", f"Bought the {product}. {body}", f"{body} ({product})"])
    return {"review": review, "label": label, "answer": SENTIMENTS[label]}


SENTIMENT_YAML = task_yaml(
    "retail_sentiment",
    "multiple_choice",
    """\
doc_to_text: "Review: {{review}}\\nSentiment:"
doc_to_choice:
- positive
- negative
- neutral
doc_to_target: label
""",
    "acc",
    "Sentiment of a short product review, positive / negative / neutral (multiple choice, log-likelihood).",
)

# ---------------------------------------------------------------- retail_faulty_item

FAULTY_TEMPLATES = [
    "I ordered the {ok} and the {bad}. The {bad} arrived broken.",
    "The {bad} does not work, but the {ok} is fine.",
    "Got my {ok} and {bad} today; the {bad} is missing a part.",
    "The {ok} is great. Sadly the {bad} stopped working after a day.",
    "Both parcels came. The {ok} is fine, the {bad} arrived cracked.",
    "Please replace the {bad}: faulty on arrival. No problem with the {ok}.",
    "The {bad} from my last order is damaged. I will keep the {ok}.",
    "Love the {ok}! The {bad}, however, broke on day one.",
]


def faulty_item(rng: random.Random) -> dict:
    ok, bad, *others = rng.sample(PRODUCTS, 4)
    choices = [ok, bad, *others]
    rng.shuffle(choices)
    message = rng.choice(FAULTY_TEMPLATES).format(ok=ok, bad=bad)
    return {"message": message, "choices": choices, "label": choices.index(bad), "answer": bad}


FAULTY_YAML = task_yaml(
    "retail_faulty_item",
    "multiple_choice",
    """\
doc_to_text: "Message: {{message}}\\nFaulty item:"
doc_to_choice: choices
doc_to_target: label
""",
    "acc",
    "Which of four products a complaint says is faulty; two of them are named in the message (multiple choice, log-likelihood).",
)

# ---------------------------------------------------------------- retail_order_id


def order_number(rng: random.Random) -> str:
    return f"{rng.choice(string.ascii_uppercase)}{rng.choice(string.ascii_uppercase)}-{rng.randint(10000, 99999)}"


def phone(rng: random.Random) -> str:
    return f"0{rng.randint(100, 999)} {rng.randint(1000, 9999)} {rng.randint(100, 999)}"


def order_item(rng: random.Random) -> dict:
    order = order_number(rng)
    product = rng.choice(PRODUCTS)
    name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    amount = f"{rng.randint(10, 300)}.{rng.randint(0, 99):02d} EUR"
    day = f"{rng.randint(1, 28)} {rng.choice(MONTHS)}"
    message = rng.choice([
        f"Hi, order {order} ({product}) has not arrived yet. Call me on {phone(rng)}. {name}",
        f"Order {order}: the {product} arrived broken. I paid {amount}. Please refund.",
        f"Hello, I want to return the {product} from order {order}, bought on {day}.",
        f"Can you change the address for order {order}? It is now {rng.randint(1, 200)} Station Road. Thanks, {name}",
        f"I was charged {amount} twice for order {order}. My phone is {phone(rng)}.",
        f"The {product} I got on {day} came in the wrong colour. Order number {order}, customer {name}.",
    ])
    return {"message": message, "answer": order}


ORDER_YAML = task_yaml(
    "retail_order_id",
    "generate_until",
    """\
doc_to_text: "Message: My toaster from order KT-40213 arrived with a dent. Call me on 0151 2234 889.\\nOrder number: KT-40213\\n\\nMessage: {{message}}\\nOrder number:"
doc_to_target: answer
generation_kwargs:
  until:
  - "\\n"
  max_gen_toks: 12
  do_sample: false
  temperature: 0.0
filter_list:
- name: strip
  filter:
  - function: remove_whitespace
  - function: take_first
""",
    "exact_match",
    "Copy the order number out of a customer message (exact match; one worked example in the prompt).",
)

SETS = [
    RealSet("retail_sentiment", sentiment_item, "review", SENTIMENT_YAML),
    RealSet("retail_order_id", order_item, "message", ORDER_YAML),
    RealSet("retail_faulty_item", faulty_item, "message", FAULTY_YAML),
]


def items_of(real_set: RealSet, count: int = ITEMS, seed: int = SEED, held_out: int = 0) -> list[dict]:
    """`count` distinct items, each with an id; one generator per set (seeded by the set's name).

    With `held_out`, that many more distinct items follow from the same stream (ids `...-cal-NNNN`): the
    set's calibration.jsonl, never equal to a scored item (docs/calibration.md, `from-eval-sets`).
    """
    rng = random.Random(f"{seed}:{real_set.name}")
    seen: set[str] = set()
    items: list[dict] = []
    while len(items) < count + held_out:
        item = real_set.make_item(rng)
        if item[real_set.key] in seen:
            continue
        seen.add(item[real_set.key])
        index = len(items)
        ident = f"{real_set.name}-{index:04d}" if index < count else f"{real_set.name}-cal-{index - count:04d}"
        items.append({"id": ident, **item})
    return items


def _jsonl(items: list[dict]) -> str:
    return "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)


def files_of(real_set: RealSet) -> dict[str, str]:
    header = "# Generated by python -m pipelines.demo.real_sets\n"
    items = items_of(real_set, held_out=HELD_OUT)
    return {
        f"{real_set.name}.yaml": header + real_set.yaml,
        "data.jsonl": _jsonl(items[:ITEMS]),
        "calibration.jsonl": _jsonl(items[ITEMS:]),
    }


def write_sets(root: Path = EVAL_SETS_DIR, *, check: bool = False) -> list[str]:
    """Write (or, with check, compare) every set's files; returns the files that differ or were written."""
    changed = []
    for real_set in SETS:
        folder = root / real_set.name
        for name, text in files_of(real_set).items():
            path = folder / name
            if path.is_file() and path.read_text() == text:
                continue
            changed.append(str(path))
            if not check:
                folder.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.demo.real_sets", description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=EVAL_SETS_DIR)
    parser.add_argument("--check", action="store_true", help="exit 1 if a file on disk differs from what is generated")
    args = parser.parse_args(argv)
    changed = write_sets(args.root, check=args.check)
    for path in changed:
        print(("differs: " if args.check else "wrote: ") + path)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
