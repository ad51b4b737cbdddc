"""llama-cpp-python's OpenAI server, started so that it accepts any X-Request-ID: run by .venv-llamacpp's Python, never
imported by the project (it imports nothing of ours).

    .venv-llamacpp/bin/python pipelines/serve/llamacpp_launch.py --model F.gguf ...   # llama_cpp.server's own arguments

llama-cpp-python's app puts starlette-context's RequestIdPlugin in front of every route, and that plugin answers 400 Bad
Request to a request whose X-Request-ID is not a UUID (measured with llama-cpp-python 0.3.36). vllm bench serve sends
`x-request-id: bench-<hex>-<n>` with every request, so without this every request of a load test failed. The plugin's
own switch, `validate=False`, keeps the header as the request's id without checking it; nothing else changes.
"""

from __future__ import annotations

import runpy

from starlette_context.plugins.base import PluginUUIDBase

_checked_init = PluginUUIDBase.__init__


def _lenient_init(self, *args, **kwargs) -> None:
    kwargs["validate"] = False
    _checked_init(self, *args, **kwargs)


if __name__ == "__main__":
    PluginUUIDBase.__init__ = _lenient_init
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
