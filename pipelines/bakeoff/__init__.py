"""The bake-off: one intent (a recipe) through every quantize backend, judged the same way (docs/backends.md).

    plan     the rows: each recipe x each backend, checked before any row runs (bad input is exit 2)
    loop     every row through a row runner (quantize_and_gate; a fake in unit tests), a refusal or a failure a row
    records  what a row and the whole bake-off hold (bakeoff.json)
    table    the table (terminal and Markdown) and the two conclusions: smallest passing, fastest passing
    plot     bytes against the measured throughput ratio, one marker per verdict (bakeoff.png)
    output   artifacts/bakeoffs/<model>-<UTC stamp>/, written atomically
"""
