"""Sub-commands of `quantize`. Each module exposes `register(subparsers)`; the handler it sets with
`parser.set_defaults(handler=...)` takes the parsed arguments and returns the exit code."""
