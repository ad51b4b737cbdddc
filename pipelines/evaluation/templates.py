"""Eval-set templates rendered as lm-eval renders them, in a sandbox with a time and an output budget.

An eval set's doc_to_* templates are the user's code, rendered for every item at validation before lm-eval
(which renders them without a sandbox) sees them. Jinja's sandbox refuses `_` attributes (`__globals__`),
unsafe methods and changes to lists and dicts; this module adds budgets enforced while rendering, never
checked only afterwards:

- time (CPU time of the rendering thread, not the wall clock: a loaded machine is not a hostile template): a deadline
  per item, one per set (RenderBudget) and one per command over every set it renders (CommandBudget: twelve sets each
  just inside their own budget do not add up to minutes), the set's and the command's growing with the number of
  renderings (a large legitimate set is never refused for its size); checked at every call, filter, attribute or
  item access, operator, loop iteration and output chunk; every `{% for %}` iterates through a checked iterator, so
  nested loops that write nothing still stop;
- output: what a template writes is streamed and counted (per item and per set), and every value a call,
  filter, operator or `~` produces, and every value written or turned into text, is held to a size;
  operations whose result size an argument chooses (`center(2000000000)`, `'%2000000000s'`, `join`,
  `replace`, `indent`, `wordwrap`, `lipsum`, `tojson(indent)`, `regex_replace`) are refused from their
  arguments, before they allocate;
- `regex_replace` (lm-eval's one custom filter) runs on the `regex` module with the item's remaining time
  as its timeout: a pattern that backtracks without end cannot hang a C-level search.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.nodes
import jinja2.runtime
import jinja2.sandbox
import jinja2.utils
import jinja2.visitor
import regex  # type: ignore[import-untyped]

from pipelines.evaluation.budget import SECONDS_PER_RENDER, CommandBudget, TimeBudget, command_budget

MAX_RENDERED_CHARS = 1_000_000  # one rendered template, and any one value a template builds or writes
MAX_SET_RENDERED_CHARS = 100_000_000  # every template of a set over all its items, plus CHARS_PER_RENDER a rendering
CHARS_PER_RENDER = 1_000
MAX_VALUE_WEIGHT = 10_000_000  # what a value may become as text (a list of a shared big list counts each reference)
ITEM_SECONDS = 2.0  # one template against one item
SET_SECONDS = 10.0  # every template of a set against all its items (+ SECONDS_PER_RENDER each: pipelines.evaluation.budget)
MAX_EXPONENT = 1024
# An integer no template needs is one Python cannot even print (about 4,300 digits): refused before it is computed,
# since one C-level power or product cannot be interrupted by the time budget.
MAX_INTEGER_BITS = 64_000
MAX_JSON_INDENT = 16
# Budgets count the CPU time of the rendering thread: a template bomb spends CPU, while a process that waits for a CPU spends
# none (a CI run on 2 loaded cores saw a trivial template "take more than 2 s" of wall-clock time between two checks).
_clock = time.thread_time
_WEIGHT_OF_ATOM = 32  # a number, None, a bool: at most this many characters (an int of 4,300 digits is refused by Python)
_WEIGHT_OF_OBJECT = 64  # anything else: its default repr
_FORMAT_NUMBER = re.compile(r"\d+")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")


class TemplateBudgetError(jinja2.sandbox.SecurityError):
    """A template went past its time or output budget while rendering."""


class CommandBudgetError(TemplateBudgetError):
    """The command's templates, over every set it renders, went past the command's time budget."""




@dataclass
class RenderBudget:
    """One set's rendering: time and characters shared by its items, within the command's budget."""

    seconds: float = SET_SECONDS
    chars: int = MAX_SET_RENDERED_CHARS  # what is left to write (grows by chars_per_render a rendering)
    chars_per_render: int = CHARS_PER_RENDER
    per_render: float = SECONDS_PER_RENDER
    command: CommandBudget = field(default_factory=command_budget)
    time: TimeBudget = field(init=False)
    chars_limit: int = field(init=False)

    def __post_init__(self) -> None:
        self.time = TimeBudget(self.seconds, self.per_render)
        self.chars_limit = self.chars

    def render(self, template: jinja2.Template, doc: dict) -> str:
        """`template` against one item, streamed: stops at the first check past a budget (TemplateBudgetError)."""
        for budget in (self.time, self.command):
            budget.renders += 1
        self.chars += self.chars_per_render
        self.chars_limit += self.chars_per_render
        started = _clock()
        limits = ((ITEM_SECONDS, None), (self.time.left, self.time), (self.command.left, self.command))
        seconds, limit = min(limits, key=lambda pair: pair[0])
        item = _ItemState(self, started + seconds, limit)
        previous, _ACTIVE.item = getattr(_ACTIVE, "item", None), item
        try:
            if seconds <= 0:
                item.check_time()
            return "".join(item.written(chunk) for chunk in template.generate(**doc))
        finally:
            _ACTIVE.item = previous
            spent = _clock() - started
            self.time.spent += spent
            self.command.spent += spent


@dataclass
class _ItemState:
    budget: RenderBudget
    deadline: float
    limit: TimeBudget | None  # the budget the deadline comes from: the item's own (None), the set's or the command's
    chars: int = 0

    def check_time(self) -> None:
        if _clock() <= self.deadline:
            return
        if isinstance(self.limit, CommandBudget):
            raise CommandBudgetError(f"this command's templates took more than {self.limit.describe()} to render in all")
        if self.limit is not None:
            raise TemplateBudgetError(f"the set's templates took more than {self.limit.describe()} to render in all")
        raise TemplateBudgetError(f"rendering one item took more than {ITEM_SECONDS:g} s of CPU")

    def written(self, chunk: str) -> str:
        self.check_time()
        self.chars += len(chunk)
        self.budget.chars -= len(chunk)
        if self.chars > MAX_RENDERED_CHARS:
            raise TemplateBudgetError(f"renders more than {MAX_RENDERED_CHARS} characters")
        if self.budget.chars < 0:
            raise TemplateBudgetError(f"the set's templates render more than {self.budget.chars_limit} characters in all")
        return chunk


_ACTIVE = threading.local()  # the item being rendered in this thread (RenderBudget.render)


def _tick() -> None:
    item = getattr(_ACTIVE, "item", None)
    if item is not None:
        item.check_time()


def _seconds_left() -> float:
    item = getattr(_ACTIVE, "item", None)
    return ITEM_SECONDS if item is None else max(0.001, item.deadline - _clock())


# ---------------------------------------------------------------- sizes


def _weight(value: Any, limit: int = MAX_VALUE_WEIGHT) -> int:
    """About how many characters `value` becomes as text (a shared sub-list counted once per reference),
    stopping early once past `limit`; containers are walked with the clock checked."""
    seen: dict[int, int] = {}
    steps = 0

    def weigh(node: Any) -> int:
        nonlocal steps
        if isinstance(node, (str, bytes)):
            return len(node)
        if node is None or isinstance(node, (bool, int, float)):
            return _WEIGHT_OF_ATOM
        if isinstance(node, jinja2.utils.Namespace):
            node = dict(node._Namespace__attrs)  # its repr shows its attributes
        if not isinstance(node, (list, tuple, set, frozenset, dict)):
            return _WEIGHT_OF_OBJECT
        if id(node) in seen:
            return seen[id(node)]
        total = 2
        for element in (part for pair in node.items() for part in pair) if isinstance(node, dict) else node:
            steps += 1
            if steps % 4096 == 0:
                _tick()
            total += weigh(element) + 2
            if total > limit:
                break
        seen[id(node)] = total
        return total

    return weigh(value)


def _refuse_heavy(*values: Any) -> None:
    for value in values:
        if _weight(value) > MAX_VALUE_WEIGHT:
            raise TemplateBudgetError(f"a value would become more than {MAX_VALUE_WEIGHT} characters of text")


def _refuse_large_numbers(args: Iterable[Any], what: str) -> None:
    """A size argument past the output budget is a size no rendered text can hold (`center(2000000000)`)."""
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > MAX_RENDERED_CHARS:
            raise TemplateBudgetError(f"{what}: the argument {arg} is larger than {MAX_RENDERED_CHARS}")


def _refuse_estimate(what: str, size: int) -> None:
    if size > MAX_RENDERED_CHARS:
        raise TemplateBudgetError(f"{what} would produce about {size} characters (more than {MAX_RENDERED_CHARS})")


def _bounded_result(value: Any, what: str) -> Any:
    """A produced value held to the size limit; an iterator comes back as a checked one."""
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) and len(value) > MAX_RENDERED_CHARS:
        raise TemplateBudgetError(f"{what} produced {len(value)} characters or items (more than {MAX_RENDERED_CHARS})")
    if isinstance(value, Iterator) and not isinstance(value, (str, bytes)):
        return _budgeted_iter(value)
    return value


def _budgeted_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    """The iterable with the clock checked at every item: what every `{% for %}` iterates."""
    for count, item in enumerate(iterable):
        if count >= MAX_RENDERED_CHARS:
            raise TemplateBudgetError(f"a loop runs more than {MAX_RENDERED_CHARS} times")
        _tick()
        yield item


def _format_widths(template: str, args: tuple, kwargs: dict) -> None:
    """`'%2000000000s'`, `'{:2000000000}'`, `'%*s'` and `'{:{w}}'`: refused before formatting allocates."""
    for number in _FORMAT_NUMBER.findall(template):
        if len(number) > 7 or int(number) > MAX_RENDERED_CHARS:
            raise TemplateBudgetError(f"a format width or precision of {number} is larger than {MAX_RENDERED_CHARS}")
    if "*" in template or _NESTED_FIELD.search(template):
        _refuse_large_numbers([*args, *kwargs.values()], "format")
    _refuse_heavy(template, args, kwargs)


# ---------------------------------------------------------------- what a filter or method may produce, from its arguments


def _join_size(items: list, separator: Any = "", attribute: Any = None) -> int:
    return _weight(items) + _weight(separator) * len(items)


def _replace_size(text: Any, old: Any, new: Any, count: Any = None) -> int:
    if not isinstance(text, str) or not isinstance(old, str) or not isinstance(new, str):
        return 0
    found = len(text) + 1 if old == "" else text.count(old)
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return len(text) + found * max(0, len(new) - len(old))


def _indent_size(text: Any, width: Any = 4, first: Any = False, blank: Any = False) -> int:
    if not isinstance(text, str):
        return 0
    step = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    return len(text) + step * (text.count("\n") + 1)


def _wordwrap_size(text: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None, *rest: Any, **kwargs: Any) -> int:
    if not isinstance(text, str) or not isinstance(width, int) or width < 1:
        return 0
    breaks = len(text) // width + text.count("\n") + 1
    return len(text) + len(wrapstring if isinstance(wrapstring, str) else "\n") * breaks


def _expandtabs_size(text: Any, tabsize: Any = 8) -> int:
    return len(text) + text.count("\t") * tabsize if isinstance(text, str) and isinstance(tabsize, int) else 0


def _translate_size(text: Any, table: Any) -> int:
    if not isinstance(text, str) or not isinstance(table, dict):
        return 0
    longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
    return len(text) * max(1, longest)


def _tojson_size(value: Any, indent: Any = None) -> int:
    if isinstance(indent, int) and indent > MAX_JSON_INDENT:
        raise TemplateBudgetError(f"tojson: an indent of {indent} is larger than {MAX_JSON_INDENT}")
    return _weight(value) * (1 + (indent if isinstance(indent, int) else 0))


def _sum_size(values: list, attribute: Any = None, start: Any = 0) -> int:
    return sum(len(v) for v in values if isinstance(v, (str, list, tuple))) + (len(start) if isinstance(start, (str, list, tuple)) else 0)


def _lipsum_size(n: Any = 5, html: Any = True, min: Any = 20, max: Any = 100) -> int:
    return (n if isinstance(n, int) else 0) * (max if isinstance(max, int) else 100) * 16


# filter name -> (upper bound of the result's length from (value, *args), whether the value is materialised first)
_FILTER_SIZES: dict[str, tuple[Callable[..., int], bool]] = {
    "join": (_join_size, True),
    "replace": (_replace_size, False),
    "indent": (_indent_size, False),
    "wordwrap": (_wordwrap_size, False),
    "tojson": (_tojson_size, False),
    "sum": (_sum_size, True),
}
# Filters and str methods whose number arguments are sizes of what they produce (`center(2000000000)`).
_SIZED_FILTERS = frozenset({"center", "indent", "wordwrap", "truncate", "batch", "slice", "round", "tojson"})
_SIZED_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
_METHOD_SIZES: dict[str, Callable[..., int]] = {  # str methods, from (the string, *args)
    "join": lambda separator, items=(): _join_size(list(items), separator) if isinstance(items, list) else 0,
    "replace": _replace_size,
    "expandtabs": _expandtabs_size,
    "translate": _translate_size,
}


def _regex_replace(string: str, pattern: str, repl: str, count: int = 0) -> str:
    """lm-eval's one custom filter (lm_eval/utils.py: re.sub), with a timeout and its output counted as it grows."""
    produced = len(string)

    def replacement(match: Any) -> str:
        nonlocal produced
        text = match.expand(repl)
        produced += len(text) - len(match.group(0))
        _refuse_estimate("regex_replace", produced)
        return text

    try:
        return regex.sub(pattern, replacement, string, count=count, timeout=_seconds_left())
    except TimeoutError:
        raise TemplateBudgetError(f"regex_replace took more than {ITEM_SECONDS:g} s of CPU") from None


# ---------------------------------------------------------------- the environment


class _BoundedLoops(jinja2.visitor.NodeTransformer):
    """Every `{% for %}` iterates through `_budgeted_iter`; every `~` is a size-checked join."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        self.generic_visit(node)
        node.iter = jinja2.nodes.Filter(node.iter, "_budgeted_iter", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        self.generic_visit(node)
        return jinja2.nodes.Filter(jinja2.nodes.List(node.nodes, lineno=node.lineno), "_concat", [], [], None, None, lineno=node.lineno)


def _concat(parts: list) -> str:
    _refuse_heavy(parts)
    return _bounded_result(jinja2.utils.concat(str(part) for part in parts), "~")


def _finalize(value: Any) -> Any:
    """Every `{{ value }}` before it becomes text."""
    _tick()
    _refuse_heavy(value)
    return value


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    skip = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0
    size, materialise = _FILTER_SIZES.get(name, (None, False))

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        value, rest = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
        if materialise and value is not None and not isinstance(value, (str, list)):
            value = list(_budgeted_iter(value))
            args = (*args[:skip], value, *rest)
        if name == "format" and isinstance(value, str):
            _format_widths(value, rest, kwargs)
        else:
            if name in _SIZED_FILTERS:
                _refuse_large_numbers([*rest, *kwargs.values()], name)
            _refuse_heavy(value, rest, kwargs)
        if size is not None:
            _refuse_estimate(name, size(value, *rest, **kwargs))
        return _bounded_result(function(*args, **kwargs), name)

    return bounded


class Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """lm-eval's Jinja settings (StrictUndefined, trailing newline kept, `regex_replace`), sandboxed and budgeted.

    No compile-time constant folding: every value is computed while rendering, under the budgets."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            loader=jinja2.BaseLoader(), undefined=jinja2.StrictUndefined, keep_trailing_newline=True, optimized=False,
            finalize=_finalize,
        )
        self.filters["regex_replace"] = _regex_replace
        self.filters = {name: _bounded_filter(name, function) for name, function in self.filters.items()}
        self.filters["_budgeted_iter"] = _budgeted_iter
        self.filters["_concat"] = _concat

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        return _BoundedLoops().visit(super()._parse(source, name, filename))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise jinja2.sandbox.SecurityError(f"exponent {right} is larger than {MAX_EXPONENT}")
        _bounded_integer(operator, left, right)
        if operator == "*":
            for sequence, times in ((left, right), (right, left)):
                if isinstance(sequence, (str, list, tuple)) and isinstance(times, int) and _weight(sequence) * times > MAX_VALUE_WEIGHT:
                    raise jinja2.sandbox.SecurityError(f"a sequence repeated {times} times is too long")
        if operator == "%" and isinstance(left, str):
            _format_widths(left, right if isinstance(right, tuple) else (right,), right if isinstance(right, dict) else {})
        return _bounded_result(super().call_binop(context, operator, left, right), operator)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        template = value.__self__

        @functools.wraps(wrapped)
        def checked(*args: Any, **kwargs: Any) -> str:
            _format_widths(template, args, {**kwargs, **(args[0] if value.__name__ == "format_map" and args and isinstance(args[0], dict) else {})})
            return _bounded_result(wrapped(*args, **kwargs), "format")

        checked.checks_its_arguments = True  # type: ignore[attr-defined]
        return checked

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _tick()
        name = getattr(__obj, "__name__", "a call")
        on_string = isinstance(getattr(__obj, "__self__", None), str)
        if not getattr(__obj, "checks_its_arguments", False):
            if on_string and name in _SIZED_METHODS:
                _refuse_large_numbers([*args, *kwargs.values()], name)
            _refuse_heavy(args, kwargs)
        if on_string and name in _METHOD_SIZES:
            if name == "join" and args and not isinstance(args[0], (str, list)):
                args = (list(_budgeted_iter(args[0])), *args[1:])
            _refuse_estimate(name, _METHOD_SIZES[name](__obj.__self__, *args, **kwargs))
        if name == "generate_lorem_ipsum":
            _refuse_estimate("lipsum", _lipsum_size(*args, **kwargs))
        return _bounded_result(super().call(__context, __obj, *args, **kwargs), name)


SANDBOX = Sandbox()


@functools.lru_cache(maxsize=256)
def compile_template(source: str) -> jinja2.Template:
    """A template compiled once in the sandbox (jinja2.TemplateSyntaxError for a malformed one)."""
    return SANDBOX.from_string(source)


def render_template(source: str, doc: dict, budget: RenderBudget | None = None) -> str:
    """`source` against one item, as lm-eval renders it, under `budget` (a fresh set budget when None)."""
    return (budget or RenderBudget()).render(compile_template(source), doc)


def _bounded_integer(operator: str, left: Any, right: Any) -> None:
    """Refuse `**` and `*` on integers whose result would exceed MAX_INTEGER_BITS, before computing it."""
    if not (isinstance(left, int) and isinstance(right, int)) or isinstance(left, bool) or isinstance(right, bool):
        return
    if operator == "**" and right > 0:
        bits = abs(left).bit_length() * right
    elif operator == "*":
        bits = abs(left).bit_length() + abs(right).bit_length()
    else:
        return
    if bits > MAX_INTEGER_BITS:
        raise jinja2.sandbox.SecurityError(f"an integer of about {bits:,} bits is larger than {MAX_INTEGER_BITS:,}")
