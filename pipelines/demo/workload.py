"""The synthetic business workload of the demo model: a customer-service desk of a small retailer.

Each task draws items from a `random.Random`, so a seed fixes the whole data set. An item is a flat
dict of the fields the eval set's YAML renders; `answer` is the text the model must produce after the
prompt (for multiple choice it is the gold choice, and `label` is its index).

Tried and dropped, within the training budget on 2 CPU cores: pulling an order number out of the middle
of a message (0% exact match after 300 steps: the model learns to copy from a fixed distance, as in
payment_reference, long before it learns to search), a memorised 160-SKU bin catalogue (6% after 900
steps) and counting boxes on a packing list (17% after 450 steps).
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

FIRST_NAMES = (
    "Anna", "Ben", "Carla", "David", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Lars",
    "Maya", "Nils", "Olga", "Pavel", "Rosa", "Sami", "Tara", "Uwe", "Vera", "Wim", "Yara", "Zoe",
)
LAST_NAMES = (
    "Meyer", "Novak", "Rossi", "Silva", "Jansen", "Kowalski", "Dubois", "Larsen", "Moreau", "Weber",
    "Costa", "Berg", "Fischer", "Keller", "Horvat", "Lind", "Brandt", "Ortiz", "Quinn", "Sato",
)
PRODUCTS = (
    "kettle", "blender", "desk lamp", "office chair", "router", "printer", "coffee maker", "headset",
    "monitor", "keyboard", "backpack", "toaster", "speaker", "webcam", "vacuum cleaner", "heater",
    "smart watch", "tablet", "drill", "rice cooker",
)
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
    "November", "December",
)
GREETINGS = ("", "Hello.", "Hi!", "Hi team.", "Good morning.", "Hello support team.", "Hey there!")
CLOSINGS = ("", "Thanks.", "Thank you.", "Regards, {name}.", "Best, {name}.", "Please help.", "Cheers, {name}.")
ASIDES = (
    "", "", "This is urgent.", "I am a customer since {year}.", "My name is {name}.",
    "I have tried twice already.", "Please reply by email.",
)

DEPARTMENTS = ("Billing", "Shipping", "Returns", "Technical", "Accounts", "Sales")
ISSUES: dict[str, tuple[str, ...]] = {
    "Billing": (
        "I was charged twice for {order}.",
        "My invoice shows {amount} but the price was lower.",
        "Please send me a copy of the invoice for {order}.",
        "The card payment failed but the money was taken.",
        "Why is there a late fee on my bill?",
        "The tax on invoice {invoice} looks wrong.",
        "I paid {amount} by bank transfer and it is not on my statement.",
        "Can I pay the invoice for {order} in two parts?",
        "You billed me {amount} for a plan I cancelled.",
        "My credit card was charged {amount} without an order.",
    ),
    "Shipping": (
        "Where is my parcel for {order}?",
        "The courier has not arrived with my {product}.",
        "Tracking for {order} has not changed since {date}.",
        "Can you deliver the {product} to a different address?",
        "The delivery of {order} is a week late.",
        "The parcel was left at the wrong house.",
        "The driver said my address could not be found.",
        "Can I pick up the {product} at a depot instead of home delivery?",
        "Only half of {order} was delivered on {date}.",
        "How long does delivery to Norway take?",
    ),
    "Returns": (
        "I want to return the {product} from {order}.",
        "The {product} arrived broken and I would like to send it back.",
        "How do I get a return label for {order}?",
        "Can I exchange the {product} for another colour?",
        "You received my return on {date} but I have no credit yet.",
        "The {product} is not what I ordered, I want to send it back.",
        "Is the return window still open for {order}?",
        "I sent the {product} back but the return is not processed.",
        "Do I have to pay postage to return the {product}?",
        "I would like to swap the {product} for a larger model.",
    ),
    "Technical": (
        "The {product} will not turn on.",
        "The {product} shows error code E{code}.",
        "How do I reset the {product} to factory settings?",
        "The firmware update failed on my {product}.",
        "The app crashes when I connect the {product}.",
        "The {product} makes a loud noise after ten minutes.",
        "The {product} keeps losing the wifi connection.",
        "The display of the {product} flickers.",
        "The {product} gets very hot when I use it.",
        "The battery of the {product} drains overnight.",
    ),
    "Accounts": (
        "I cannot log in to my account.",
        "Please change the email address on my account.",
        "The password reset link does not arrive.",
        "Please delete my account and my data.",
        "I was locked out after too many attempts.",
        "How do I update my phone number in my profile?",
        "Someone else seems to have access to my account.",
        "Please merge my two customer accounts.",
        "I want to stop the newsletter emails.",
        "The two step login code never arrives.",
    ),
    "Sales": (
        "Do you offer a discount for {qty} units of the {product}?",
        "I would like a quote for {qty} {product}s for our office.",
        "Is the {product} available in blue?",
        "When will the {product} be back in stock?",
        "Can I get a business price for {qty} units?",
        "Which {product} do you recommend for a small team?",
        "Do you sell spare parts for the {product}?",
        "Is there a newer model of the {product} coming soon?",
        "Can we open a trade account for regular orders?",
        "Do you ship {qty} {product}s to a company abroad?",
    ),
}

def _clean(text: str) -> str:
    """Single spaces, and a capital letter at the start of every sentence."""
    text = " ".join(text.split())
    return re.sub(r"(^|[.!?] )([a-z])", lambda match: match.group(1) + match.group(2).upper(), text)


def _pick(rng: random.Random, options: tuple[str, ...]) -> str:
    return options[rng.randrange(len(options))]


def _letters(rng: random.Random, count: int) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(count))


def _digits(rng: random.Random, count: int) -> str:
    return "".join(rng.choice(string.digits) for _ in range(count))


def order_number(rng: random.Random) -> str:
    return f"ORD-{_digits(rng, 5)}-{_letters(rng, 2)}"


def _slots(rng: random.Random) -> dict[str, str]:
    name = f"{_pick(rng, FIRST_NAMES)} {_pick(rng, LAST_NAMES)}"
    return {
        "name": name,
        "order": order_number(rng),
        "invoice": f"INV-{_digits(rng, 6)}",
        "customer": f"C-{_digits(rng, 5)}",
        "ticket": f"T{_digits(rng, 4)}",
        "parcel": f"PX{_digits(rng, 8)}",
        "phone": f"0{_digits(rng, 3)} {_digits(rng, 6)}",
        "amount": f"{rng.randint(5, 999)}.{_digits(rng, 2)} EUR",
        "date": f"{rng.randint(1, 28)} {_pick(rng, MONTHS)}",
        "year": str(rng.randint(2009, 2025)),
        "code": _digits(rng, 2),
        "qty": str(rng.randint(2, 60)),
        "product": _pick(rng, PRODUCTS),
        "product2": _pick(rng, PRODUCTS),
    }


def _fill(template: str, slots: dict[str, str]) -> str:
    return _clean(template.format(**slots))


def routing_item(rng: random.Random) -> dict:
    slots = _slots(rng)
    label = rng.randrange(len(DEPARTMENTS))
    parts = [
        _pick(rng, GREETINGS),
        _pick(rng, ISSUES[DEPARTMENTS[label]]),
        _pick(rng, ASIDES),
        _pick(rng, CLOSINGS),
    ]
    if rng.random() < 0.3:
        parts[1], parts[2] = parts[2], parts[1]
    return {"ticket": _fill(" ".join(parts), slots), "label": label, "answer": DEPARTMENTS[label]}


def reference_item(rng: random.Random) -> dict:
    """A 16-digit payment reference written in four groups, to be returned joined by dashes."""
    groups = [_digits(rng, 4) for _ in range(4)]
    slots = _slots(rng)
    lead = _pick(rng, ("Payment from {name}", "Transfer of {amount}", "Refund for {order}", "Card payment on {date}"))
    return {"note": _fill(lead, slots), "reference": " ".join(groups), "answer": "-".join(groups)}


def date_item(rng: random.Random) -> dict:
    year, month, day = rng.randint(2015, 2029), rng.randint(1, 12), rng.randint(1, 28)
    style = rng.randrange(3)
    if style == 0:
        written = f"{day} {MONTHS[month - 1]} {year}"
    elif style == 1:
        written = f"{MONTHS[month - 1]} {day}, {year}"
    else:
        written = f"{day:02d}.{month:02d}.{year}"
    return {"written": written, "answer": f"{year}-{month:02d}-{day:02d}"}


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    output_type: Literal["multiple_choice", "generate_until"]
    prompt: str  # a Jinja template over the item's fields, as lm-eval's doc_to_text renders it
    make_item: Callable[[random.Random], dict]
    key_fields: tuple[str, ...]  # the fields that make an item unique (train/eval disjointness)
    choices: tuple[str, ...] = ()
    max_gen_toks: int = 32


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task(
            name="ticket_routing",
            description="Route a customer ticket to one of six departments (multiple choice, log-likelihood).",
            output_type="multiple_choice",
            prompt="Ticket: {{ticket}}\nDepartment:",
            make_item=routing_item,
            key_fields=("ticket",),
            choices=DEPARTMENTS,
        ),
        Task(
            name="payment_reference",
            description="Rewrite a 16-digit payment reference into its canonical dashed form (exact match).",
            output_type="generate_until",
            prompt="{{note}}, reference {{reference}}\nCanonical reference:",
            make_item=reference_item,
            key_fields=("note", "reference"),
            max_gen_toks=24,
        ),
        Task(
            name="date_normalisation",
            description="Rewrite a written date as YYYY-MM-DD (exact match).",
            output_type="generate_until",
            prompt="Date: {{written}}\nISO date:",
            make_item=date_item,
            key_fields=("written",),
            max_gen_toks=16,
        ),
    )
}


def item_key(task: Task, item: dict) -> tuple[str, ...]:
    return (task.name, *(str(item[field]) for field in task.key_fields))
