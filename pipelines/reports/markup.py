"""The page shell and its blocks. Text in, escaped markup out: a block escapes every str it is given (markupsafe);
only a Markup value (what another block or pipelines.reports.charts built) passes through as markup.

    page("Run 2026...", verdict_banner("promoted", "..."), section("Eval sets", table(columns, rows)))
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from markupsafe import Markup, escape

Cell = str | Markup
# A run's verdict, a registry status, a repair's status: which colour its banner takes (others: amber).
VERDICT_CLASSES = {"promoted": "pass", "repaired": "pass", "passed": "pass", "rejected": "fail", "error": "fail",
                   "budget exhausted": "fail", "ladder exhausted": "fail", "does not fit": "fail"}

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5rem auto; max-width: 1240px; color: #1d2330;
       padding: 0 1rem; line-height: 1.4; }
h1 { font-size: 1.6rem; margin: 0.2rem 0; } h2 { font-size: 1.2rem; margin-top: 2rem; border-bottom: 1px solid #d0d5de; }
h3 { font-size: 1rem; }
.verdict { padding: 0.8rem 1rem; border-radius: 6px; border: 2px solid; margin-bottom: 1rem; }
.verdict.pass { background: #e8f6ec; border-color: #2e8b57; } .verdict.fail { background: #fdecec; border-color: #c0392b; }
.verdict.other { background: #fff6e0; border-color: #c98a00; }
.verdict .word { font-size: 1.8rem; font-weight: 700; letter-spacing: 0.04em; }
table { border-collapse: collapse; margin: 0.5rem 0; font-size: 0.85rem; }
th, td { border: 1px solid #d0d5de; padding: 0.25rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f2f4f8; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.fail td { background: #fdf1f0; }
.note { color: #4a5366; font-size: 0.85rem; } code { background: #f2f4f8; padding: 0 0.2rem; }
.scroll { overflow-x: auto; } svg { display: block; margin: 0.2rem 0; } .chart text { font-size: 11px; fill: #1d2330; }
"""


def page(title: str, *blocks: Markup) -> str:
    """A whole document: inline CSS, no script and no external resource (a file:// page that fetches nothing)."""
    head = Markup('<meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">'
                  '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; style-src \'unsafe-inline\'; img-src data:">')
    body = Markup("\n").join(blocks)
    # ASCII with character references: the file reads the same whatever encoding the writer's locale has.
    return str(Markup("<!DOCTYPE html>\n<html lang=\"en\"><head>{}<title>{}</title><style>{}</style></head>\n<body>\n{}\n</body></html>\n")
               .format(head, title, Markup(_STYLE), body)).encode("ascii", "xmlcharrefreplace").decode("ascii")


def verdict_banner(verdict: str, title: str, lines: Iterable[str] = ()) -> Markup:
    """The verdict first, as plain HTML: the word, what the page is about, then its reasons or headline."""
    css = VERDICT_CLASSES.get(verdict.lower(), "other")
    items = Markup("").join(Markup("<li>{}</li>").format(line) for line in lines)
    listed = Markup("<ul>{}</ul>").format(items) if items else Markup("")
    return Markup('<div class="verdict {}" id="verdict"><div class="word">{}</div><h1>{}</h1>{}</div>').format(
        css, verdict.upper(), title, listed)


def section(title: str, *blocks: Markup, anchor: str | None = None) -> Markup:
    identifier = Markup(' id="{}"').format(anchor) if anchor else Markup("")
    return Markup("<section{}><h2>{}</h2>\n{}\n</section>").format(identifier, title, Markup("\n").join(blocks))


def heading(title: str) -> Markup:
    return Markup("<h3>{}</h3>").format(title)


def paragraph(text: Cell, css: str | None = None) -> Markup:
    return Markup('<p class="{}">{}</p>').format(css, text) if css else Markup("<p>{}</p>").format(text)


def note(text: Cell) -> Markup:
    return paragraph(text, "note")


def bullets(items: Iterable[Cell]) -> Markup:
    return Markup("<ul>{}</ul>").format(Markup("").join(Markup("<li>{}</li>").format(item) for item in items))


def _is_number(text: Cell) -> bool:
    stripped = str(text).replace(",", "").replace("%", "").strip()
    try:
        float(stripped.split()[0] if stripped else "x")
    except ValueError:
        return False
    return True


def _row(cells: Sequence[Cell], css: str | None, identifier: str | None) -> Markup:
    tds = Markup("").join(Markup('<td class="num">{}</td>').format(c) if _is_number(c) else Markup("<td>{}</td>").format(c) for c in cells)
    attributes = Markup("")
    if css:
        attributes += Markup(' class="{}"').format(css)
    if identifier:
        attributes += Markup(' id="{}"').format(identifier)
    return Markup("<tr{}>{}</tr>").format(attributes, tds)


def table(columns: Sequence[str], rows: Sequence[Sequence[Cell]], *, row_classes: Sequence[str | None] | None = None,
          row_ids: Sequence[str | None] | None = None, css: str | None = None) -> Markup:
    """A table of text cells (escaped); `row_classes` ("pass"/"fail") and `row_ids` per row, when given."""
    head = Markup("").join(Markup("<th>{}</th>").format(column) for column in columns)
    classes = row_classes or [None] * len(rows)
    identifiers = row_ids or [None] * len(rows)
    body = Markup("\n").join(_row(row, c, i) for row, c, i in zip(rows, classes, identifiers, strict=True))
    table_class = Markup(' class="{}"').format(css) if css else Markup("")
    return Markup('<div class="scroll"><table{}><thead><tr>{}</tr></thead><tbody>\n{}\n</tbody></table></div>').format(table_class, head, body)


def key_values(rows: Sequence[Sequence[Cell]]) -> Markup:
    """Two-column facts (the header of a page): the key as a row heading."""
    body = Markup("\n").join(Markup("<tr><th>{}</th><td>{}</td></tr>").format(key, value) for key, value in rows)
    return Markup("<table><tbody>\n{}\n</tbody></table>").format(body)


def code(text: str) -> Markup:
    return Markup("<code>{}</code>").format(text)


def anchor_id(prefix: str, name: str, index: int) -> str:
    """An id for a row that names user data safely: the index keeps it unique, the name only in its printable ASCII."""
    kept = "".join(c if c.isascii() and c.isalnum() else "-" for c in name)[:40]
    return f"{prefix}-{index}-{kept}"


__all__ = ["Cell", "Markup", "anchor_id", "bullets", "code", "escape", "heading", "key_values", "note", "page", "paragraph",
           "section", "table", "verdict_banner"]
