"""Rendering a set's templated keys (doc_to_text, doc_to_target, doc_to_choice, ...) against its items as lm-eval
will, in the product's Jinja sandbox under the set's render budget (pipelines.evaluation.templates): which item fields
a template reads, each key compiled once, each item rendered with its problem named (file, key, data line)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox

from pipelines.errors import InputError
from pipelines.evaluation.templates import SANDBOX, CommandBudgetError, RenderBudget, TemplateBudgetError, compile_template
from pipelines.files.jsonl import display_path
from pipelines.files.yamlio import FunctionRef

# The keys lm-eval renders as Jinja templates against each item (lm_eval/api/task.py: doc_to_*, resolve_field).
TEMPLATE_KEYS = ("doc_to_text", "doc_to_target", "doc_to_choice", "gen_prefix", "description", "doc_to_decontamination_query")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class CommandRenderStopped(InputError):
    """The command's rendering budget ran out on this set: an error of the command, not of the set (never skipped)."""



def template_fields(value: Any, *, bare_is_field: bool, where: str = "", key: str = "") -> set[str]:
    """Item fields a doc_to_* value reads: Jinja variables, or a bare name lm-eval looks up in the item."""
    if isinstance(value, FunctionRef) or not isinstance(value, (str, list)):
        return set()
    if isinstance(value, list):
        return set().union(*(template_fields(v, bare_is_field=False, where=where, key=key) for v in value)) if value else set()
    if "{{" in value or "{%" in value or "{#" in value:
        return set(jinja2.meta.find_undeclared_variables(_parse_template(value, where, key)))
    return {value} if bare_is_field and _IDENTIFIER.match(value) else set()


def _parse_template(template: str, where: str, key: str):
    try:
        return SANDBOX.parse(template)
    except jinja2.TemplateSyntaxError as error:
        raise InputError(f"Jinja syntax error: {error.message} (line {error.lineno} of the template)", file=where, field=key) from None
    except (RecursionError, MemoryError):
        raise InputError("Jinja template nested too deep", file=where, field=key) from None


def compile_templates(config: dict, where: str) -> dict[str, jinja2.Template]:
    """Every templated key that is a plain string, compiled in the sandbox; a syntax error names the key."""
    compiled = {}
    for key in TEMPLATE_KEYS:
        value = config.get(key)
        if isinstance(value, str) and not isinstance(value, FunctionRef):
            _parse_template(value, where, key)
            try:
                compiled[key] = compile_template(value)
            except jinja2.TemplateError as error:
                raise InputError(f"Jinja template refused: {error}", file=where, field=key) from None
    return compiled


def render_item(
    compiled: dict[str, jinja2.Template], config: dict, item: dict, where: str, data: Path, number: int, budget: RenderBudget,
) -> dict[str, str]:
    """Render every template against one item as lm-eval will (a bare field name is a lookup), in the sandbox
    under the set's budget; returns what each rendered."""
    rendered = {}
    for key, template in compiled.items():
        if config[key] in item:
            continue  # lm-eval reads the field, it renders nothing
        try:
            text = budget.render(template, item)
        except CommandBudgetError as error:
            raise CommandRenderStopped(f"stopped: {error} (rendering {display_path(data)} line {number})", file=where, field=key) from None
        except TemplateBudgetError as error:
            problem = f"stopped: {error}"
        except jinja2.sandbox.SecurityError as error:
            problem = f"refused by the template sandbox: {error}"
        except jinja2.UndefinedError as error:
            problem = f"undefined in the template: {error.message}"
        except Exception as error:  # whatever a template raises is the template's fault (MemoryError and RecursionError too)
            problem = f"the template fails: {type(error).__name__}: {error}"
        else:
            if key == "doc_to_choice" and not _is_choice_list(text):
                problem = f"must render a Python list literal of choices (got {text[:80]!r})"
            else:
                rendered[key] = text
                continue
        raise InputError(f"{problem} (rendering {display_path(data)} line {number})", file=where, field=key)
    return rendered


def _is_choice_list(text: str) -> bool:
    """lm-eval reads a rendered doc_to_choice with ast.literal_eval and expects a list."""
    try:
        return isinstance(ast.literal_eval(text.strip()), (list, tuple))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
