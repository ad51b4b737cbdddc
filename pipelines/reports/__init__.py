"""The HTML pages a person opens in a browser: one per run, per repair and per model.

    markup      the page shell (inline CSS, no script, no network fetch) and its blocks: tables, lists, key/value rows
    charts      inline SVG: an interval against its limit (a set's worsening against its tolerance, a load-test ratio
                against the policy's), and a scatter (a repair's frontier, a model's verdicts over time)
    run_page    a gate run's page from its gate.json (report.html beside report.md)
    model_page  a registry model's page: its versions, aliases, verdicts over time and events
    locate      what `quantize report RUN_ID|NAME` names: a run folder, a repair folder or a registry model

Every string from input (model, set and recipe names, reasons, paths) is HTML-escaped: the blocks take plain text and
escape it (markupsafe), and only what they build themselves is markup. The verdict is plain HTML at the top of each
page, readable without JavaScript (there is none). A repair's page is pipelines.repair.page (it reads the repair's
own records, a floor above this one).
"""
