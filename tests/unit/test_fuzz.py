"""Hostile input to every command that reads a file or a name: each case exits 2 with one error line.

The contract under test (docs/exit-codes.md): bad input never ends in a traceback, never in exit 1 (which
CI reads as "rejected by the gate"), never in heavy work (no llm-compressor oneshot, no vLLM server, no
lm-eval run), and never changes the artifacts tree. Inputs: non-UTF-8 bytes, a byte-order mark, nesting
3,000 deep, oversized files, YAML anchors and aliases (an alias bomb), wrong types, NaN and infinities,
integers past every bound, rich markup, control characters and path-traversal names.

The CLI runs in-process through pipelines.cli.main (fast); a few cases run `python -m pipelines.cli` in a
real process, where the peak memory of the hostile-YAML cases is measured too.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from fakes import TASK_CONFIG, write_eval_set

from pipelines import cli
from pipelines.evaluation.evalsets import discover_eval_sets as DISCOVER_EVAL_SETS  # the real one: the `quantize` fixture replaces it

ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = ROOT / "models" / "demo-llama"
RECIPES = ROOT / "recipes"
DEFAULT_POLICY = ROOT / "policies" / "default.yaml"
MiB = 1024 * 1024
RSS_LIMIT_MB = 200

# --------------------------------------------------------------------------------- hostile payloads


def alias_bomb(levels: int = 9, width: int = 9) -> bytes:
    """"Billion laughs": 9 levels of 9 aliases each, about 400 bytes that expand to 9**9 strings."""
    lines = ["l0: &l0 [" + ", ".join(['"lol"'] * width) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return ("\n".join(lines) + "\n").encode()


def deep_flow(depth: int = 3000) -> bytes:
    return b"a: " + b"[" * depth + b"]" * depth + b"\n"


def deep_block(depth: int = 200) -> bytes:
    return "".join("  " * i + f"k{i}:\n" for i in range(depth)).encode() + b"  " * depth + b"v\n"


# Every YAML reader gets these; none of them is a valid recipe, policy, job or task YAML.
YAML_PAYLOADS: dict[str, bytes] = {
    "non-utf8": b"name: x\xff\xfe\n",
    "latin-1": "name: caf\xe9\n".encode("latin-1"),
    "utf-16": "name: x\n".encode("utf-16"),
    "bom-then-a-list": b"\xef\xbb\xbf- a\n- b\n",
    "nul-byte": b"name: a\x00b\n",
    "escape-char": b"name: \x1b[2Jx\n",
    "binary": bytes(random.Random(0).randrange(256) for _ in range(4096)),
    "deep-flow-3000": deep_flow(),
    "deep-block-200": deep_block(),
    "alias-bomb": alias_bomb(),
    "recursive-alias": b"a: &a [1, *a]\n",
    "undefined-alias": b"a: *nowhere\n",
    "alias-placed-deep": b"a: &a " + b"[" * 40 + b"1" + b"]" * 40 + b"\nb: " + b"[" * 30 + b"*a" + b"]" * 30 + b"\n",
    "oversize-2mib": b"# " + b"x" * (2 * MiB) + b"\n",
    "many-values": b"a: [" + b"1, " * 30_000 + b"1]\n",
    "empty": b"",
    "top-level-list": b"- 1\n- 2\n",
    "top-level-scalar": b"just text\n",
    "multi-document": b"a: 1\n---\nb: 2\n",
    "python-tag": b"a: !!python/object/apply:os.system ['touch /tmp/quantgate-fuzz-pwned']\n",
    "nan": b"a: .nan\n",
    "negative-inf": b"a: [1, -.inf]\n",
    "float-overflow": b"a: 1.0e+999\n",
    "int-5000-digits": b"a: " + b"9" * 5000 + b"\n",
    "bad-date": b"a: 2024-13-45\n",
    "unhashable-key": b"? [a]\n: 1\n",
    "unclosed": b"a: [1, 2\n",
    "tab-indent": b"a:\n\tb: 1\n",
}


def yaml_bytes(value: object) -> bytes:
    return yaml.safe_dump(value, sort_keys=False, allow_unicode=True).encode()


def edited(base: dict, path: str, value: object) -> dict:
    """A deep copy of `base` with the dotted `path` set to `value` (missing mappings created)."""
    out = json.loads(json.dumps(base))
    node = out
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return out


def raw_with(base: dict, path: str, scalar: str) -> bytes:
    """YAML text of `base` with `path` set to a raw YAML scalar (`.nan`, a 5,000-digit integer...)."""
    marker = "__FUZZ_VALUE__"
    return yaml_bytes(edited(base, path, marker)).replace(marker.encode(), scalar.encode())


HUGE = 10**30
NUMBER_SCALARS = {"nan": ".nan", "inf": ".inf", "neg-inf": "-.inf", "huge": str(HUGE), "negative": "-5", "zero": "0"}

RECIPE = yaml.safe_load((RECIPES / "gptq.yaml").read_text())
RECIPE_TYPED: dict[str, bytes] = {
    **{f"group-size-{k}": raw_with(RECIPE, "groups.attention.weights.group_size", v) for k, v in NUMBER_SCALARS.items()},
    **{f"num-samples-{k}": raw_with(RECIPE, "calibration.num_samples", v) for k, v in NUMBER_SCALARS.items()},
    "dampening-nan": raw_with(RECIPE, "algorithm.dampening_frac", ".nan"),
    "dampening-inf": raw_with(RECIPE, "algorithm.dampening_frac", ".inf"),
    "block-size-huge": raw_with(RECIPE, "algorithm.block_size", str(HUGE)),
    "max-seq-length-huge": raw_with(RECIPE, "calibration.max_seq_length", str(HUGE)),
    "seed-huge": raw_with(RECIPE, "calibration.seed", str(2**80)),
    "bits-as-text": yaml_bytes(edited(RECIPE, "groups.attention.weights.bits", "eight")),
    "groups-as-number": yaml_bytes(edited(RECIPE, "groups", 5)),
    "layers-huge": yaml_bytes({**RECIPE, "overrides": [{"layers": [HUGE], "keep": True}]}),
    "regex-unbalanced": yaml_bytes({**RECIPE, "overrides": [{"match": "(", "keep": True}]}),
    "name-markup-close": yaml_bytes({**RECIPE, "name": "[/x]"}),
    "name-markup-link": yaml_bytes({**RECIPE, "name": "[link=http://evil.example]x[/link]"}),
    "name-traversal": yaml_bytes({**RECIPE, "name": "../../etc/passwd"}),
    "name-control": yaml_bytes({**RECIPE, "name": "x\u001b[2J"}),
    "unknown-key": yaml_bytes({**RECIPE, "run": "rm -rf /"}),
}

POLICY = yaml.safe_load(DEFAULT_POLICY.read_text())
POLICY_TYPED: dict[str, bytes] = {
    **{f"max-abs-drop-{k}": raw_with(POLICY, "defaults.max_abs_drop", v) for k, v in NUMBER_SCALARS.items() if k != "zero"},
    **{f"min-items-{k}": raw_with(POLICY, "defaults.min_items", v) for k, v in NUMBER_SCALARS.items()},
    "max-kl-inf": raw_with(POLICY, "defaults.max_kl", ".inf"),
    "flip-rate-nan": raw_with(POLICY, "defaults.max_flip_rate", ".nan"),
    "fit-gpu-unknown": yaml_bytes(edited(POLICY, "fit.gpu", "B9000")),
    "fit-gpu-markup": yaml_bytes(edited(POLICY, "fit.gpu", "[/x][link=http://evil.example]")),
    "fit-gpu-traversal": yaml_bytes(edited(POLICY, "fit.gpu", "../../etc/passwd")),
    "fit-gpu-number": yaml_bytes(edited(POLICY, "fit.gpu", 5)),
    "fit-max-model-len-huge": yaml_bytes(edited(POLICY, "fit.max_model_len", 10**12)),
    "fit-max-model-len-zero": yaml_bytes(edited(POLICY, "fit.max_model_len", 0)),
    "fit-max-model-len-nan": raw_with(POLICY, "fit.max_model_len", ".nan"),
    "fit-concurrency-huge": yaml_bytes(edited(POLICY, "fit.concurrency", HUGE)),
    "fit-memory-inf": raw_with({k: v for k, v in POLICY.items() if k != "fit"}, "fit", "{memory_gib: .inf, max_model_len: 512}"),
    "recipe-fit-gpu-unknown": yaml_bytes(edited(POLICY, "recipes.w8a8", {"fit": {"gpu": "B9000", "max_model_len": 512}})),
    "schema-version-2": yaml_bytes({**POLICY, "schema_version": 2}),
}

DEMO_CONFIG = json.loads((DEMO_MODEL / "config.json").read_text())


def config_bytes(**changes: object) -> bytes:
    return json.dumps({**DEMO_CONFIG, **changes}).encode()


CONFIG_PAYLOADS: dict[str, bytes] = {
    "non-utf8": b'{"hidden_size": 256, "x": "\xff"}',
    "nan": b'{"hidden_size": NaN}',
    "infinity": config_bytes().replace(b'"hidden_size": 256', b'"hidden_size": Infinity'),
    "neg-infinity": config_bytes().replace(b'"hidden_size": 256', b'"hidden_size": -Infinity'),
    "deep-nesting": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "oversize-5mib": b'{"pad": "' + b"x" * (5 * MiB) + b'"}',
    "top-level-list": b"[1, 2]",
    "top-level-string": b'"config"',
    "truncated": b'{"hidden_size": 256',
    "layers-2e7-float": config_bytes(num_hidden_layers=2e7),
    "layers-2e7": config_bytes(num_hidden_layers=20_000_000),
    "hidden-huge": config_bytes(hidden_size=HUGE, num_attention_heads=1, head_dim=64),
    "vocab-huge": config_bytes(vocab_size=HUGE),
    "vocab-negative": config_bytes(vocab_size=-1),
    "heads-zero": config_bytes(num_attention_heads=0),
    "layers-bool": config_bytes(num_hidden_layers=True),
    "head-dim-text": config_bytes(head_dim="64"),
    "intermediate-huge": config_bytes(intermediate_size=HUGE),
    "max-position-huge": config_bytes(max_position_embeddings=HUGE),
    "sliding-window-pattern-negative": config_bytes(sliding_window=64, sliding_window_pattern=-1),
    "sliding-window-pattern-text": config_bytes(sliding_window=64, sliding_window_pattern="2"),
    "sliding-window-huge": config_bytes(sliding_window=HUGE),
    "max-window-layers-text": config_bytes(sliding_window=64, use_sliding_window=True, max_window_layers="a"),
    "kv-bits-text": config_bytes(quantization_config={"kv_cache_scheme": {"num_bits": "x"}}),
    "kv-bits-huge": config_bytes(quantization_config={"kv_cache_scheme": {"num_bits": 10**6}}),
    "experts-huge": config_bytes(num_local_experts=HUGE, num_experts_per_tok=2),
    "shared-expert-text": config_bytes(num_local_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size="x"),
    "layer-types-wrong-length": config_bytes(sliding_window=64, layer_types=["sliding_attention"]),
}

PLAN_ARGUMENTS: dict[str, list[str]] = {
    **{f"gpu-memory-gib-{v}": ["--gpu-memory-gib", v] for v in ("1e300", "nan", "inf", "-inf", "-1", "0", "lots")},
    **{f"gpu-bandwidth-gbs-{v}": ["--gpu", "T4", "--gpu-bandwidth-gbs", v] for v in ("1e300", "nan", "0")},
    **{f"max-model-len-{v}": ["--gpu", "T4", "--max-model-len", v] for v in ("0", "-1", str(HUGE), "1.5", "\u00b2", "9" * 5000)},
    **{f"concurrency-{v}": ["--gpu", "T4", "--concurrency", v] for v in ("0", str(HUGE), "nan")},
    **{f"max-num-batched-tokens-{v}": ["--gpu", "T4", "--max-num-batched-tokens", v] for v in ("0", str(HUGE))},
    **{f"overhead-fraction-{v}": ["--gpu", "T4", "--overhead-fraction", v] for v in ("nan", "1", "2")},
    **{f"overhead-gib-{v}": ["--gpu", "T4", "--overhead-gib", v] for v in ("inf", "1e300", "-1")},
    **{f"utilization-{v}": ["--gpu", "T4", "--max-gpu-memory-utilization", v] for v in ("0", "nan", "2")},
    **{f"gpu-{k}": ["--gpu", v] for k, v in {"unknown": "B9000", "markup": "[/x]", "traversal": "../../etc/passwd", "empty": ""}.items()},
    "recipe-traversal": ["--gpu", "T4", "--recipe", "../../../../etc/passwd"],
    "recipe-dev-zero": ["--gpu", "T4", "--recipe", "/dev/zero"],
    "recipe-name-too-long": ["--gpu", "T4", "--recipe", "r" * 5000],
}

TASK = {**TASK_CONFIG, "task": "s"}
ITEMS = b'{"question": "q1", "answer": "a1"}\n{"question": "q2", "answer": "a2"}\n'


def task_with(**changes: object) -> bytes:
    return yaml_bytes({**TASK, **changes})


def data_files(path: str) -> bytes:
    return task_with(dataset_kwargs={"data_files": {"test": path}})


TEMPLATE_PAYLOADS: dict[str, bytes] = {
    "jinja-globals": task_with(doc_to_text="{{ self.__init__.__globals__ }}"),
    "jinja-os-popen": task_with(doc_to_text="{{ cycler.__init__.__globals__.os.popen('touch /tmp/quantgate-fuzz-pwned').read() }}"),
    "jinja-class-mro": task_with(doc_to_text="{{ ''.__class__.__mro__[1].__subclasses__() }}"),
    "jinja-list-append": task_with(doc_to_text="{% set x = [] %}{{ x.append(1) }}{{ question }}"),
    "jinja-syntax-error": task_with(doc_to_text="{{ question "),
    "jinja-syntax-error-target": task_with(doc_to_target="{% if %}"),
    "jinja-undefined": task_with(doc_to_text="{{ question.missing.deeper }}"),
    "jinja-division-by-zero": task_with(doc_to_text="{{ 1 / 0 }}"),
    "jinja-huge-range": task_with(doc_to_text="{% for i in range(10**9) %}x{% endfor %}"),
    "jinja-huge-repeat": task_with(doc_to_text="{{ 'x' * 10**10 }}"),
    "jinja-huge-power": task_with(doc_to_text="{{ 9 ** 99999999 }}"),
    # Stopped while rendering by the template budgets (pipelines.evaluation.templates), each within seconds and megabytes.
    "jinja-nested-range-loops": task_with(doc_to_text="{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
    "jinja-center-2e9": task_with(doc_to_text="{{ question|center(2000000000) }}"),
    "jinja-ljust-2e9": task_with(doc_to_text="{{ question.ljust(2000000000) }}"),
    "jinja-percent-width-2e9": task_with(doc_to_text="{{ '%2000000000s' % question }}"),
    "jinja-format-width-2e9": task_with(doc_to_text="{{ '{:2000000000}'.format(question) }}"),
    "jinja-join-of-copies": task_with(doc_to_text="{{ (['x' * 10000] * 500)|join }}"),
    "jinja-shared-sublists": task_with(doc_to_text="{% set a = [1] * 100000 %}{% set b = [a,a,a,a,a,a,a,a,a,a] %}{{ [b,b,b,b,b,b,b,b,b,b] }}"),
    "jinja-exponential-macro": task_with(doc_to_text="{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}"),
    "jinja-regex-backtracking": task_with(doc_to_text="{{ ('a' * 5000 ~ '!')|regex_replace('(a|aa)+$', '') }}"),
    # Each power within the exponent cap, the result not: refused before one uninterruptible C-level power runs.
    "jinja-power-of-powers": task_with(doc_to_text="{{ ((((2**1024)**1024)**128)**1024) > 1 }}"),
    "jinja-product-of-powers": task_with(doc_to_text="{% set a = 2**1000 %}{% set b = a*a*a*a*a*a*a*a %}{{ b*b*b*b*b*b*b*b*b*b > 1 }}"),
    "jinja-choice-not-a-list": task_with(output_type="multiple_choice", doc_to_choice="{{ question }}", doc_to_target="0",
                                         metric_list=[{"metric": "acc"}]),
}
DATA_FILE_PAYLOADS: dict[str, bytes] = {
    "data-files-absolute": data_files("/etc/passwd"),
    "data-files-dotdot": data_files("../other/data.jsonl"),
    "data-files-deep-dotdot": data_files("sub/../../../etc/passwd"),
    "data-files-home": data_files("~/data.jsonl"),
    "data-files-url": data_files("https://evil.example/data.jsonl"),
    "data-files-glob": data_files("*.jsonl"),
    "data-files-symlink-out": data_files("escape.jsonl"),
    "data-files-list": task_with(dataset_kwargs={"data_files": {"test": ["a.jsonl", "b.jsonl"]}}),
    "data-dir": task_with(dataset_kwargs={"data_files": {"test": "data.jsonl"}, "data_dir": "/etc"}),
    "test-split-unhashable": task_with(test_split=["test"]),
    "include-key": task_with(include="../../other.yaml"),
}
DATA_PAYLOADS: dict[str, bytes] = {
    "data-non-utf8": b'{"question": "q\xff", "answer": "a"}\n',
    "data-nan": b'{"question": "q", "answer": NaN}\n',
    "data-infinity": b'{"question": "q", "answer": Infinity}\n',
    "data-deep": b'{"question": "q", "answer": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
    "data-not-an-object": b'["q", "a"]\n',
    "data-invalid-json": b'{"question": "q", \n',
    "data-empty": b"",
    "data-template-field-self": b'{"question": "q", "answer": "a", "self": 1}\n',
    "data-line-over-1mib-no-newline": b'{"question": "' + b"x" * (2 * MiB),
}

JOB = {"name": "fuzz", "registry": "REGISTRY", "candidates": [{"model": str(DEMO_MODEL), "recipes": ["w8a8"]}]}
JOB_TYPED: dict[str, bytes] = {
    "max-model-len-zero": yaml_bytes({**JOB, "max_model_len": 0}),
    "max-model-len-nan": raw_with(JOB, "max_model_len", ".nan"),
    "max-model-len-huge": yaml_bytes({**JOB, "max_model_len": HUGE}),
    "name-traversal": yaml_bytes({**JOB, "name": "../../etc/x"}),
    "name-markup": yaml_bytes({**JOB, "name": "[/x]"}),
    "no-candidates": yaml_bytes({**JOB, "candidates": []}),
    "candidate-model-traversal": yaml_bytes({**JOB, "candidates": [{"model": "../../../../etc", "recipes": ["w8a8"]}]}),
    "candidate-recipe-traversal": yaml_bytes({**JOB, "candidates": [{"model": str(DEMO_MODEL), "recipes": ["../../../../etc/passwd"]}]}),
    "candidate-recipe-markup": yaml_bytes({**JOB, "candidates": [{"model": str(DEMO_MODEL), "recipes": ["[/x]"]}]}),
    "target-gpu-unknown": yaml_bytes({**JOB, "defaults": {"target": {"gpu": "B9000", "max_model_len": 512}}}),
    "target-max-model-len-huge": yaml_bytes({**JOB, "defaults": {"target": {"gpu": "T4", "max_model_len": 10**12}}}),
    "registry-as-number": yaml_bytes({**JOB, "registry": 5}),
    "candidates-as-text": yaml_bytes({**JOB, "candidates": "all"}),
}

# --------------------------------------------------------------------------------- the harness


# SQLite's shared-memory index and write-ahead log of a WAL database: a reader may create them, they hold
# no content of their own (registry.db itself, size and mtime, is compared).
SQLITE_SIDE_FILES = ("-shm", "-wal")


def listing(root: Path) -> list[tuple[str, int, int]]:
    """Every path under root with its size and modification time: what "unchanged" is compared by."""
    out = []
    for path in sorted(root.rglob("*")):
        if path.name.endswith(SQLITE_SIDE_FILES):
            continue
        stat = path.lstat()
        out.append((path.relative_to(root).as_posix(), stat.st_size if path.is_file() else 0, stat.st_mtime_ns))
    return out


class HeavyWorkStarted(AssertionError):
    """Raised by the tripwires: a fuzz case got past validation into quantizing, serving or scoring."""


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    """A private artifacts root with a registry holding one promoted version, and a folder of inputs."""
    from fakes import make_artifact, make_gate, new_version, promote

    from pipelines.registry.store import Registry

    base = tmp_path_factory.mktemp("fuzz")
    artifacts = base / "artifacts"
    artifacts.mkdir()
    registry = Registry(artifacts / "registry.db")
    version = registry.register(new_version(make_artifact(base / "artifact"), make_gate(base / "gate.json")))
    promote(registry, version)
    from pipelines.registry.signing import load_signer

    load_signer(artifacts / "registry.db")  # the project's signing key beside the registry, as after a first real run
    inputs = base / "inputs"
    inputs.mkdir()
    return types.SimpleNamespace(base=base, artifacts=artifacts, registry=artifacts / "registry.db", inputs=inputs)


@pytest.fixture
def quantize(world, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> Callable[..., tuple[int, str, str]]:
    """Run the CLI in-process against the private artifacts root, with every heavy step a tripwire."""
    import pipelines.evaluation.evalsets
    import pipelines.jobs.job
    import pipelines.quantize.oneshot
    import pipelines.runs.runner
    from pipelines.commands import gate as gate_command
    from pipelines.runs.stack import GateStack

    monkeypatch.setenv("QUANTGATE_ARTIFACTS", str(world.artifacts))
    monkeypatch.setenv("QUANTGATE_REGISTRY", str(world.registry))  # pipelines.settings: read when used, not at import

    def tripwire(*args, **kwargs):
        raise HeavyWorkStarted("a fuzz case reached heavy work")

    for module, name in ((pipelines.quantize.oneshot, "run_oneshot"), (pipelines.jobs.job, "run_candidate"), (gate_command, "run_gate")):
        monkeypatch.setattr(module, name, tripwire)
    monkeypatch.setattr(pipelines.runs.runner, "STACK", GateStack(serve=tripwire, score=tripwire))
    monkeypatch.setattr(pipelines.evaluation.evalsets, "discover_eval_sets", lambda root=None: [])  # eval sets have their own cases
    # A job compiles each recipe against its model's layout, built by importing torch and transformers
    # (10 s); the demo model is valid and no case here is about it.
    monkeypatch.setattr(pipelines.jobs.job, "_model_layout", lambda model, field: None, raising=False)

    def run(*argv: str) -> tuple[int, str, str]:
        before = listing(world.artifacts)
        code = cli.main(list(argv))
        captured = capsys.readouterr()
        assert listing(world.artifacts) == before, "the artifacts tree changed"
        return code, captured.out, captured.err

    return run


def assert_refused(result: tuple[int, str, str], *named: str, table_on_stdout: bool = False, progress_first: bool = False) -> str:
    """Exit 2, exactly one `quantize: error:` line on stderr, nothing on stdout (`eval-sets validate`
    prints its table of every set first), and every `named` string in the line. `progress_first`: progress
    lines (`> ...`, a warning) may come before it."""
    code, out, err = result
    lines = [line for line in err.strip().splitlines() if not (progress_first and line.startswith("> "))]
    assert code == 2, (code, err[-2000:])
    assert len(lines) == 1, err[-2000:]
    assert lines[0].startswith("quantize: error: "), lines[0]
    assert "Traceback" not in err and "Traceback" not in out
    assert ("error" in out) if table_on_stdout else out == "", out[-2000:]
    for word in named:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def write(world, name: str, data: bytes) -> Path:
    path = world.inputs / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def params(prefix: str, cases: dict) -> list:
    return [pytest.param(value, id=f"{prefix}:{key}") for key, value in cases.items()]


# --------------------------------------------------------------------------------- the cases


@pytest.mark.parametrize("payload", params("recipe-validate", {**YAML_PAYLOADS, **RECIPE_TYPED}))
def test_recipe_validate_refuses(world, quantize, payload: bytes, request) -> None:
    recipe = write(world, f"{request.node.callspec.id}.yaml", payload)
    assert_refused(quantize("recipe", "validate", str(recipe)), str(recipe))


@pytest.mark.parametrize("payload", params("run-recipe", {**YAML_PAYLOADS, **RECIPE_TYPED}))
def test_quantize_recipe_refuses(world, quantize, payload: bytes, request) -> None:
    recipe = write(world, f"{request.node.callspec.id}.yaml", payload)
    assert_refused(quantize("--recipe", str(recipe), "--model", str(DEMO_MODEL)), str(recipe))


@pytest.mark.parametrize("name", params("run-recipe-name", {
    "traversal": "../../../../etc/passwd", "directory": "/etc", "dev-zero": "/dev/zero", "too-long": "r" * 5000,
    "markup": "[/x]", "control": "\x1b[2J", "missing": "no-such-recipe",
}))
def test_quantize_recipe_name_refuses(quantize, name: str) -> None:
    assert_refused(quantize("--recipe", name, "--model", str(DEMO_MODEL)))


@pytest.mark.parametrize("value", params("run-max-model-len", {
    "zero": "0", "negative": "-1", "overflow": str(HUGE), "float": "1.5", "nan": "nan", "superscript": "\u00b2",
}))
def test_quantize_and_gate_refuse_a_bad_max_model_len(world, quantize, value: str) -> None:
    assert_refused(quantize("--recipe", "w8a8", "--model", str(DEMO_MODEL), "--max-model-len", value), "--max-model-len")
    gate = ("gate", "--artifact", str(world.base / "artifact"), "--baseline", str(DEMO_MODEL), "--max-model-len", value)
    assert_refused(quantize(*gate), "--max-model-len")


@pytest.mark.parametrize("payload", params("gate-policy", {**YAML_PAYLOADS, **POLICY_TYPED}))
def test_gate_policy_refuses(world, quantize, payload: bytes, request) -> None:
    policy = write(world, f"{request.node.callspec.id}.yaml", payload)
    argv = ("gate", "--artifact", str(world.base / "artifact"), "--baseline", str(DEMO_MODEL), "--policy", str(policy))
    assert_refused(quantize(*argv), str(policy))


@pytest.mark.parametrize("payload", params("plan-config", CONFIG_PAYLOADS))
def test_plan_config_refuses(world, quantize, payload: bytes, request) -> None:
    config = write(world, f"{request.node.callspec.id}.json", payload)
    assert_refused(quantize("plan", "--config", str(config), "--gpu", "T4", "--max-model-len", "512"))


@pytest.mark.parametrize("argv", params("plan-argument", PLAN_ARGUMENTS))
def test_plan_arguments_refuse(quantize, argv: list[str]) -> None:
    assert_refused(quantize("plan", "--config", str(DEMO_MODEL / "config.json"), *argv))


def eval_set_root(world, case: str, task: bytes = task_with(), data: bytes = ITEMS, set_file: bytes | None = None) -> Path:
    root = world.inputs / "eval-roots" / case
    folder = write_eval_set(root, "s", None if set_file is not None else task, data, set_file=set_file)
    (folder / "escape.jsonl").symlink_to("/etc/hostname")
    return root


EVAL_SET_CASES = {
    **{f"task-yaml-{k}": {"task": v} for k, v in YAML_PAYLOADS.items()},
    **{k: {"task": v} for k, v in {**TEMPLATE_PAYLOADS, **DATA_FILE_PAYLOADS}.items()},
    **{k: {"data": v} for k, v in DATA_PAYLOADS.items()},
    **{f"calibration-set-yaml-{k}": {"set_file": YAML_PAYLOADS[k]} for k in ("non-utf8", "alias-bomb", "deep-flow-3000", "oversize-2mib")},
    "calibration-data-nan": {"set_file": b"kind: calibration\n", "data": b'{"text": NaN}\n'},
}


@pytest.mark.parametrize("case", params("eval-sets-validate", EVAL_SET_CASES))
def test_eval_sets_validate_refuses(world, quantize, case: dict, request) -> None:
    root = eval_set_root(world, request.node.callspec.id.replace(":", "-"), **case)
    line = assert_refused(quantize("eval-sets", "validate", "--root", str(root)), table_on_stdout=True)
    assert "s/" in line or str(root) in line  # names the set's file


@pytest.mark.parametrize("root", params("eval-sets-root", {"missing": "/nonexistent/eval_sets", "a-file": "/etc/hostname"}))
def test_eval_sets_root_refuses(quantize, root: str) -> None:
    assert_refused(quantize("eval-sets", "validate", "--root", root), root)


@pytest.mark.parametrize("payload", params("job", {**YAML_PAYLOADS, **JOB_TYPED}))
def test_job_refuses(world, quantize, payload: bytes, request) -> None:
    job = write(world, f"{request.node.callspec.id}.yaml", payload.replace(b"REGISTRY", str(world.registry).encode()))
    assert_refused(quantize("job", str(job)), str(job))


JOB_FILE_NAMES = {"directory": "/etc", "dev-zero": "/dev/zero", "missing": "/no/such/job.yaml", "too-long": "j" * 5000}


@pytest.mark.parametrize("name", params("job-file", JOB_FILE_NAMES))
def test_job_file_name_refuses(quantize, name: str) -> None:
    assert_refused(quantize("job", name))


BAD_VERSIONS = {
    "zero": "0", "negative": "-1", "overflow": str(HUGE), "5000-digits": "9" * 5000, "float": "1.5", "exponent": "1e3",
    "nan": "nan", "superscript-two": "\u00b2", "arabic-one": "\u0661", "fullwidth-one": "\uff11", "space": " 1 ",
    "empty": "",
}
BAD_NAMES = {
    "markup-close": "[/x]", "markup-link": "[link=http://evil.example]x[/link]", "traversal": "../../etc/passwd",
    "control": "\x1b[2J", "long": "m" * 100_000, "unknown": "nobody",
}


@pytest.mark.parametrize("version", params("registry-show-version", BAD_VERSIONS))
def test_registry_show_refuses_bad_versions(quantize, version: str) -> None:
    assert_refused(quantize("registry", "show", "demo-llama", version))


@pytest.mark.parametrize("name", params("registry-show-model", BAD_NAMES))
def test_registry_show_refuses_bad_names(quantize, name: str) -> None:
    line = assert_refused(quantize("registry", "show", name, "1"))
    assert "\x1b" not in line


@pytest.mark.parametrize("version", params("registry-promote-version", {k: v for k, v in BAD_VERSIONS.items() if k not in ("negative",)}))
def test_registry_promote_refuses_bad_versions(quantize, version: str) -> None:
    assert_refused(quantize("registry", "promote", "demo-llama", version, "--reason", "[/x] fuzz"))


@pytest.mark.parametrize("name", params("registry-promote-model", BAD_NAMES))
def test_registry_promote_refuses_bad_names(quantize, name: str) -> None:
    assert_refused(quantize("registry", "promote", name, "1", "--reason", "fuzz"))


EVIDENCE = {
    "non-utf8": b'{"a": "\xff"}', "nan": b'{"a": NaN}', "infinity": b'{"a": Infinity}', "list": b"[1]",
    "deep": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "oversize": b'{"a": "' + b"x" * (2 * MiB) + b'"}',
    "truncated": b'{"a": 1',
}


@pytest.mark.parametrize("payload", params("registry-promote-evidence", EVIDENCE))
def test_registry_promote_refuses_bad_evidence(world, quantize, payload: bytes, request) -> None:
    evidence = write(world, f"{request.node.callspec.id}.json", payload)
    assert_refused(quantize("registry", "promote", "demo-llama", "1", "--reason", "fuzz", "--evidence", str(evidence)), str(evidence))


@pytest.mark.parametrize("version", params("registry-alias-version", BAD_VERSIONS))
def test_registry_alias_refuses_bad_versions(quantize, version: str) -> None:
    assert_refused(quantize("registry", "alias", "demo-llama", "production", version))


@pytest.mark.parametrize("alias", params("registry-alias-name", {
    "markup": "[/x]", "link": "[link=http://evil.example]x", "traversal": "../x", "digits": "12", "empty": "", "control": "\x1b[2J",
}))
def test_registry_alias_refuses_bad_alias_names(quantize, alias: str) -> None:
    assert_refused(quantize("registry", "alias", "demo-llama", alias, "1"))


@pytest.mark.parametrize("version", params("registry-history-version", {k: BAD_VERSIONS[k] for k in ("zero", "overflow", "superscript-two", "nan")}))
def test_registry_history_refuses_bad_versions(quantize, version: str) -> None:
    assert_refused(quantize("registry", "history", "demo-llama", "--version", version))


@pytest.mark.parametrize("path", params("registry-database", {"directory": "/etc", "not-sqlite": "/etc/hostname", "too-long": "d" * 5000}))
def test_registry_database_path_refuses(quantize, path: str) -> None:
    assert_refused(quantize("registry", "list", "--registry", path))


# --------------------------------------------------------------------------------- the loader itself


@pytest.mark.parametrize(("text", "words"), [
    (alias_bomb().decode(), "more than 10000 values in one file (aliases counted as what they repeat)"),
    (alias_bomb(levels=30, width=2).decode(), "more than 10000 values"),
    ("a: &a [1, *a]\n", "alias *a refers to a value that contains it"),
    ("a: &a " + "[" * 40 + "1" + "]" * 40 + "\nb: " + "[" * 30 + "*a" + "]" * 30 + "\n", "nested deeper than 64 levels (alias *a expanded)"),
    (deep_flow().decode(), "nested deeper than 64 levels"),
    (deep_block().decode(), "nested deeper than 64 levels"),
    (YAML_PAYLOADS["many-values"].decode(), "more than 10000 values"),
    ("a: [1, .nan]\n", "must be a finite number"),
    ("a: !!python/name:os.system\n", "could not determine a constructor"),
])
def test_the_loader_refuses(text: str, words: str) -> None:
    from pipelines.errors import InputError
    from pipelines.files.yamlio import load_yaml_text

    with pytest.raises(InputError, match=re.escape(words)) as caught:
        load_yaml_text(text, "x.yaml")
    assert caught.value.file == "x.yaml"


def test_the_loader_keeps_function_tags_and_accepts_what_it_should() -> None:
    from pipelines.files.yamlio import MAX_DEPTH, FunctionRef, dump_yaml, load_yaml_text

    data = load_yaml_text("a: !function helpers.score\nb: [" + "[" * (MAX_DEPTH - 3) + "1" + "]" * (MAX_DEPTH - 3) + "]\n", "x.yaml")
    assert isinstance(data["a"], FunctionRef) and data["a"] == "helpers.score"
    shared = {"weights": {"bits": 4, "group_size": 128}}  # yaml.safe_dump writes an anchor and an alias for it
    text = yaml.safe_dump({"groups": {"attention": shared, "mlp": shared}})
    assert "&id001" in text and load_yaml_text(text, "x.yaml") == {"groups": {"attention": shared, "mlp": shared}}
    assert load_yaml_text("b: &b {x: 1}\nc: {<<: *b, y: 2}\n", "x.yaml")["c"] == {"x": 1, "y": 2}
    assert load_yaml_text(dump_yaml(data), "again.yaml") == data and isinstance(load_yaml_text(dump_yaml(data), "y")["a"], FunctionRef)


# --------------------------------------------------------------------------------- positive controls


def test_a_byte_order_mark_is_accepted(world, quantize) -> None:
    bom = b"\xef\xbb\xbf"
    recipe = write(world, "bom-recipe.yaml", bom + (RECIPES / "w4a16.yaml").read_bytes())
    config = write(world, "bom-config.json", bom + (DEMO_MODEL / "config.json").read_bytes())
    code, out, err = quantize("plan", "--config", str(config), "--recipe", str(recipe), "--gpu", "T4", "--max-model-len", "512", "--json")
    assert code == 0 and [row["scheme"] for row in json.loads(out)["rows"]] == ["16-bit", "w4a16"], err


def test_json_errors_are_one_object_on_stdout(world, quantize) -> None:
    policy = write(world, "json-policy.yaml", yaml_bytes(edited(POLICY, "fit.gpu", "B9000")))
    argv = ("gate", "--artifact", str(world.base / "artifact"), "--baseline", str(DEMO_MODEL), "--policy", str(policy), "--json")
    code, out, err = quantize(*argv)
    document = json.loads(out)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert document["exit_code"] == 2 and document["kind"] == "input"
    assert document["file"] == str(policy) and document["field"] == "fit.gpu" and "B9000" in document["error"]
    code, out, _ = quantize("plan", "--config", str(DEMO_MODEL / "config.json"), "--gpu-memory-gib", "1e300", "--json")
    assert code == 2 and json.loads(out)["kind"] == "usage"


# --------------------------------------------------------------------------------- real processes

RSS_PROBE = """
import json, sys
from pipelines import cli

def peak_mb():
    # VmHWM: this process's peak resident set since exec (ru_maxrss would include the forking parent's)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024

cases = json.loads(sys.argv[1])
for name in cli.COMMANDS:  # every command module imported: the baseline every case starts from
    cli.load_command(name)
report = {"baseline_mb": peak_mb(), "cases": []}
for name, argv in cases:
    code = cli.main(argv)
    report["cases"].append([name, code, peak_mb()])
print(json.dumps(report))
"""


@pytest.mark.slow
def test_hostile_yaml_keeps_memory_bounded_in_a_real_process(tmp_path: Path) -> None:
    """The alias bomb, 3,000-deep nesting, a 50 MB recipe and 30,000 values: peak RSS stays under 200 MB."""
    files = {
        "alias-bomb": alias_bomb(),
        "alias-bomb-wide": alias_bomb(levels=12, width=12),
        "deep-flow-3000": deep_flow(),
        "deep-flow-1mib": deep_flow(MiB // 2 - 8),
        "many-values": YAML_PAYLOADS["many-values"],
        "recipe-50mb": b"name: big\ndescription: " + b"a" * (50 * MiB) + b"\n",
    }
    cases = []
    for name, data in files.items():
        path = tmp_path / f"{name}.yaml"
        path.write_bytes(data)
        cases += [[f"recipe:{name}", ["recipe", "validate", str(path)]], [f"policy:{name}", ["--recipe", "w8a8", "--policy", str(path)]],
                  [f"job:{name}", ["job", str(path)]]]
    env = {**os.environ, "QUANTGATE_ARTIFACTS": str(tmp_path / "artifacts"), "QUANTGATE_REGISTRY": str(tmp_path / "r.db")}
    result = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, json.dumps(cases)], check=False, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    errors = [line for line in result.stderr.splitlines() if not line.startswith(">")]
    assert all(code == 2 for _, code, _ in report["cases"]), report
    assert len(errors) == len(cases) and all(line.startswith("quantize: error: ") for line in errors), errors
    peak = max(rss for _, _, rss in report["cases"])
    print(f"hostile YAML: baseline {report['baseline_mb']:.0f} MB, peak {peak:.0f} MB over {len(cases)} cases")
    assert peak < RSS_LIMIT_MB, report
    assert not (tmp_path / "artifacts").exists()


@pytest.mark.slow
def test_the_entry_point_exits_2_with_one_line_for_non_utf8_and_deep_yaml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(YAML_PAYLOADS["non-utf8"])
    deep = tmp_path / "deep.yaml"
    deep.write_bytes(deep_flow())
    env = {**os.environ, "QUANTGATE_ARTIFACTS": str(tmp_path / "artifacts"), "QUANTGATE_REGISTRY": str(tmp_path / "r.db")}
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "pipelines.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )
        for name, argv in {
            "recipe": ["recipe", "validate", str(bad)],
            "policy": ["--recipe", "w8a8", "--policy", str(deep), "--json"],
        }.items()
    }
    for name, process in runs.items():
        out, err = process.communicate(timeout=120)
        assert process.returncode == 2, (name, err)
        lines = [line for line in err.splitlines() if not line.startswith(">")]
        assert len(lines) == 1 and lines[0].startswith("quantize: error: "), (name, err)
        if name == "policy":
            assert json.loads(out)["field"] == "line 1" and "nested deeper than 64" in json.loads(out)["error"]
    assert not (tmp_path / "artifacts").exists()


# --------------------------------------------------------------------------------- time and memory: bounded before reading

GiB = 1024 * MiB
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def sparse_file(path: Path, size: int = 2 * GiB) -> Path:
    """`size` bytes of NUL with no newline, written as a hole: the disk and this test pay nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        handle.truncate(size)
    return path


def test_a_2_gib_data_file_without_a_newline_is_refused_before_reading(world, quantize) -> None:
    root = world.inputs / "eval-roots" / "huge-data"
    folder = write_eval_set(root, "s", task_with(), b"")
    sparse_file(folder / "data.jsonl")
    assert_refused(quantize("eval-sets", "validate", "--root", str(root)), "s/data.jsonl", "limited to 67108864 bytes", table_on_stdout=True)
    calibration = sparse_file(world.inputs / "huge-calibration.jsonl")
    line = assert_refused(quantize("--recipe", "w8a8", "--model", str(DEMO_MODEL), "--calibration", str(calibration)))
    assert "huge-calibration.jsonl" in line and "limited to 67108864 bytes" in line


def test_a_run_never_touches_a_hanging_sibling_set(world, quantize, monkeypatch: pytest.MonkeyPatch) -> None:
    """`quantize gate ... --eval-sets good` beside a set whose template loops: only `good` is read."""
    import pipelines.evaluation.evalsets
    from pipelines.commands import gate as gate_command
    from pipelines.errors import InputError

    root = world.inputs / "sibling-roots"
    write_eval_set(root, "good", task_with(task="good"), [{"question": f"q{i}", "answer": f"a{i}"} for i in range(60)])  # enough for the policy
    write_eval_set(root, "hanging", task_with(task="hanging", doc_to_text=NESTED_LOOPS), ITEMS)
    monkeypatch.setenv("QUANTGATE_EVAL_SETS", str(root))
    monkeypatch.setattr(pipelines.evaluation.evalsets, "discover_eval_sets", DISCOVER_EVAL_SETS)
    validated: list[str] = []
    real = pipelines.evaluation.evalsets.validate_eval_set
    monkeypatch.setattr(pipelines.evaluation.evalsets, "validate_eval_set", lambda folder: validated.append(Path(folder).name) or real(folder))

    def reached(job):
        raise InputError(f"reached the gate with {[s.name for s in job.settings.eval_sets]}")

    monkeypatch.setattr(gate_command, "run_gate", reached)
    argv = ("gate", "--artifact", str(world.base / "artifact"), "--baseline", str(DEMO_MODEL), "--eval-sets", "good", "--no-loadtest")
    assert_refused(quantize(*argv), "reached the gate with ['good']")
    assert validated == ["good"]


PEAK_RSS_LIMIT_MB = 500
WALL_LIMIT_S = 30


# The command runs as the grandchild of a small launcher: a child forked from this (large) pytest process would
# carry pytest's resident pages into its peak RSS (ru_maxrss survives exec), measuring pytest instead of quantize.
LAUNCHER = ("import os, sys; pid = os.fork()\n"
            "if pid == 0: os.execv(sys.executable, [sys.executable, '-m', 'pipelines.cli', *sys.argv[1:]])\n"
            "_, status, usage = os.wait4(pid, 0); sys.stderr.write(f'\\npeak-rss-kb {usage.ru_maxrss}\\n')\n"
            "sys.exit(os.waitstatus_to_exitcode(status))")


def run_measured(argv: list[str], env: dict[str, str]) -> tuple[int, float, float, str]:
    """`python -m pipelines.cli ARGV` in its own process: exit code, wall seconds, peak RSS in MB, stderr."""
    import time

    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-c", LAUNCHER, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=env, cwd=ROOT)
    watchdog = threading.Timer(WALL_LIMIT_S + 30, process.kill)
    watchdog.start()
    try:
        err = process.stderr.read() if process.stderr else b""
        _, status, usage = os.wait4(process.pid, 0)  # reaped here, so that its own rusage (peak RSS) is read
    finally:
        watchdog.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)
    text, _, peak = err.decode(errors="replace").rpartition("\npeak-rss-kb ")
    return process.returncode, time.monotonic() - started, int(peak.split()[0]) / 1024 if peak.strip() else usage.ru_maxrss / 1024, text


@pytest.mark.slow
def test_hostile_templates_and_data_end_within_30_s_and_500_mb_in_a_real_process(tmp_path: Path) -> None:
    """The issue's time and memory cases, each as its own `quantize` process: exit 2 with one error line
    naming set, field and item, within 30 s and 500 MB of peak RSS (measured from the process's rusage)."""
    def eval_root(case: str, task: bytes = task_with(), data: bytes = ITEMS) -> Path:
        root = tmp_path / case
        write_eval_set(root, "s", task, data)
        return root

    huge_data = eval_root("huge-data", data=b"")
    sparse_file(huge_data / "s" / "data.jsonl")
    calibration = sparse_file(tmp_path / "huge-calibration.jsonl")
    cases = {
        "nested-range-loops": (["eval-sets", "validate", "--root", str(eval_root("loops", task_with(doc_to_text=NESTED_LOOPS)))],
                               "doc_to_text"),
        "center-2e9": (["eval-sets", "validate", "--root", str(eval_root("center", task_with(doc_to_text="{{ question|center(2000000000) }}")))],
                       "doc_to_text"),
        "data-2gib-no-newline": (["eval-sets", "validate", "--root", str(huge_data)], "s/data.jsonl"),
        "calibration-2gib-no-newline": (["--recipe", "w8a8", "--model", str(DEMO_MODEL), "--calibration", str(calibration)],
                                        "huge-calibration.jsonl"),
    }
    env = {**os.environ, "QUANTGATE_ARTIFACTS": str(tmp_path / "artifacts"), "QUANTGATE_REGISTRY": str(tmp_path / "r.db")}
    measured = {}
    for name, (argv, named) in cases.items():
        code, wall, peak, err = run_measured(argv, env)
        errors = [line for line in err.splitlines() if line.startswith("quantize: error: ")]
        measured[name] = f"exit {code}, {wall:.1f} s, {peak:.0f} MB"
        assert code == 2 and len(errors) == 1 and named in errors[0], (name, err[-2000:])
        assert "internal error" not in err and "Traceback" not in err, (name, err[-2000:])
        assert wall < WALL_LIMIT_S and peak < PEAK_RSS_LIMIT_MB, (name, measured[name])
    print("time and memory cases:", measured)
    assert not (tmp_path / "artifacts").exists()


# --------------------------------------------------------------------------------- repair verifies what it reads


def rejected_run(world, name: str, *, register: bool = True, verdict_registered: str = "rejected", serve: dict | None = None,
                 stages: dict | None = None) -> types.SimpleNamespace:
    """A rejected run folder under the private artifacts root as the runner leaves it: gate.json (its inputs
    naming artifact, baseline, eval set, policy and serve settings), an artifact with a full manifest, and,
    when `register`, its registry version (whose evidence is the gate.json as written with `verdict_registered`)."""
    from fakes import make_artifact, make_eval_set

    from pipelines.artifact import Manifest, PeakMemory, WeightBytes
    from pipelines.evaluation.metrics import make_spec
    from pipelines.files.hashing import file_hashes, sha256_file
    from pipelines.gate.pairing import PairedItem, SetComparison
    from pipelines.gate.policy import load_policy
    from pipelines.gate.schema import GateReport
    from pipelines.gate.verdict import decide
    from pipelines.recipe import load_recipe
    from pipelines.registry.store import NewVersion, Registry

    eval_root = world.inputs / "repair-eval-sets"
    eval_set = make_eval_set(eval_root, "tickets")
    loaded = load_recipe("aggressive")
    artifact = make_artifact(world.base / f"repair-artifact-{name}")
    (artifact / "manifest.json").unlink()
    manifest = Manifest(
        recipe="aggressive", model_name=DEMO_MODEL.name, source_model=str(DEMO_MODEL), input_key="k", recipe_file=str(loaded.path),
        recipe_text=loaded.text, compiled_recipe="", calibration=None, versions={}, source_files={}, artifact_files=file_hashes(artifact),
        layers={}, weight_bytes=WeightBytes(before=2, after=1, ratio=0.5), wall_time_s=3.0, peak_memory=PeakMemory(bytes=1), stages={},
    )
    (artifact / "manifest.json").write_text(manifest.model_dump_json())

    def report(verdict: str) -> GateReport:
        lost = 0 if verdict == "promoted" else 40
        items = [PairedItem(item_id=f"t{i}", baseline=1.0, candidate=0.0 if i < lost else 1.0, kl=0.001) for i in range(200)]
        comparison = SetComparison(eval_set="tickets", metric=make_spec("exact_match"), items=items, kl_method="top-20 logprobs")
        inputs = {
            "artifact": {"path": str(artifact), "manifest_sha256": sha256_file(artifact / "manifest.json")},
            "baseline": {"path": str(DEMO_MODEL)}, "eval_sets": {"tickets": eval_set.sha256},
            "policy": {"path": str(DEFAULT_POLICY), "sha256": sha256_file(DEFAULT_POLICY)}, "serve": serve or {"max_model_len": 256},
        }
        return GateReport(inputs=inputs, gate=decide([comparison], load_policy(DEFAULT_POLICY), "aggressive"), stages=stages or {})

    run_dir = world.artifacts / "runs" / f"20261201T000000Z-aggressive-{name}"
    run_dir.mkdir(parents=True)
    gate_json = run_dir / "gate.json"
    gate_json.write_text(report(verdict_registered).model_dump_json())
    if register:
        registry = Registry(world.registry)
        version = registry.register(NewVersion(source_model=DEMO_MODEL.name, source_hash="s", artifact_path=artifact, recipe_name="aggressive",
                                               recipe_hash=loaded.sha256, gate_path=gate_json))
        registry.reject(version.id, "rejected") if verdict_registered == "rejected" else None
    gate_json.write_text(report("rejected").model_dump_json())  # as edited (the same bytes when registered rejected)
    return types.SimpleNamespace(run_id=run_dir.name, run_dir=run_dir, gate_json=gate_json, artifact=artifact, eval_root=eval_root)


@pytest.fixture
def repair_world(world, quantize, monkeypatch: pytest.MonkeyPatch):
    """Eval sets discovered for real (the repair reads the run's recorded set) from the runs' own eval-set folder."""
    import pipelines.evaluation.evalsets

    monkeypatch.setattr(pipelines.evaluation.evalsets, "discover_eval_sets", DISCOVER_EVAL_SETS)
    monkeypatch.setenv("QUANTGATE_EVAL_SETS", str(world.inputs / "repair-eval-sets"))
    return world


def edit_json(path: Path, change: Callable[[dict], None], raw: Callable[[str], str] = lambda text: text) -> None:
    document = json.loads(path.read_text())
    change(document)
    path.write_text(raw(json.dumps(document)))


def test_repair_refuses_a_gate_json_edited_from_promoted_to_rejected(repair_world, quantize) -> None:
    run = rejected_run(repair_world, "verdict-edited", verdict_registered="promoted")
    assert_refused(quantize("repair", run.run_id), "gate.json", "differs from the gate evidence the registry recorded")


def test_repair_refuses_an_edited_manifest_recipe(repair_world, quantize) -> None:
    run = rejected_run(repair_world, "manifest-edited")
    edit_json(run.artifact / "manifest.json", lambda m: m.update(recipe_text=m["recipe_text"].replace("bits: 4", "bits: 8")))
    assert_refused(quantize("repair", run.run_id), "manifest.json", "differs from the manifest the registry recorded")


@pytest.mark.parametrize(("key", "raw", "field"), [
    ("startup_timeout_s", "1e999", "inputs.serve.startup_timeout_s"),
    ("max_num_seqs", "1000000000", "inputs.serve.max_num_seqs"),
    ("request_timeout_s", "-1e300", "inputs.serve.request_timeout_s"),
])
def test_repair_bounds_the_serve_settings_it_reads(repair_world, quantize, key: str, raw: str, field: str) -> None:
    registered = rejected_run(repair_world, f"serve-{key}")
    edit_json(registered.gate_json, lambda g: g["inputs"]["serve"].update({key: "VALUE"}), lambda text: text.replace('"VALUE"', raw))
    # 1e999 is no float: the JSON reader refuses it before the registry's comparison or the settings' bounds see it
    unreadable = ("not a finite number",) if raw == "1e999" else ()
    assert_refused(quantize("repair", registered.run_id), "gate.json", *(unreadable or ("differs from the gate evidence",)))
    unregistered = rejected_run(repair_world, f"serve-{key}-unregistered", register=False, serve={"max_model_len": 256})
    edit_json(unregistered.gate_json, lambda g: g["inputs"]["serve"].update({key: "VALUE"}), lambda text: text.replace('"VALUE"', raw))
    assert_refused(quantize("repair", unregistered.run_id, "--allow-unverified"), "gate.json", *(unreadable or (field,)), progress_first=True)


def test_repair_refuses_an_unregistered_run_unless_allowed(repair_world, quantize) -> None:
    run = rejected_run(repair_world, "unregistered", register=False)
    assert_refused(quantize("repair", run.run_id), "gate.json", "RUN_ID", "--allow-unverified")


def test_recorded_stage_times_cannot_defeat_the_repair_time(repair_world, quantize) -> None:
    """Stage times of -1e300 (before: an expected gate time below zero, so `--repair-time 1` started a real gate)."""
    from pipelines.repair.parent import MIN_GATE_S, load_parent
    from pipelines.repair.search import Budget, GateResult, Search, SearchSettings

    run = rejected_run(repair_world, "stage-times", register=False,
                       stages={"quantize_s": -1e300, "candidate_start_s": -1e300, "candidate_scoring_s": 5.0})
    parent = load_parent(run.run_id, repair_world.artifacts / "runs", registry_path=repair_world.registry, allow_unverified=True)
    assert parent.candidate_wall_s == MIN_GATE_S
    gated: list[int] = []

    def gate(k: int, why: str) -> GateResult:
        gated.append(k)
        return GateResult(passed=True, wall_s=1.0)

    search = Search(10, predict=lambda k: 1.0 / (1 + k), price=lambda k: 1000 - k, fits=lambda k: True, gate=gate,
                    budget=Budget(max_gates=4, max_wall_s=1.0), settings=SearchSettings(min_saving=0.0), target_kl=0.1,
                    expected_gate_s=parent.candidate_wall_s, started=0.0, clock=lambda: 0.0)
    assert search.run().stop == "time budget" and gated == []


def test_repair_refuses_a_gate_json_with_no_eval_sets(repair_world, quantize) -> None:
    run = rejected_run(repair_world, "no-eval-sets", register=False)
    edit_json(run.gate_json, lambda g: g["inputs"].update(eval_sets={}))
    assert_refused(quantize("repair", run.run_id, "--allow-unverified"), "gate.json", "inputs.eval_sets", progress_first=True)


# --------------------------------------------------------------------------------- every error names its file or field


def test_a_symlink_loop_as_a_model_path_is_named(world, quantize) -> None:
    loop = world.inputs / "loop"
    loop.symlink_to(loop.name)
    assert_refused(quantize("--recipe", "w8a8", "--model", str(loop)), str(loop), "--model", "Symlink loop")
    assert_refused(quantize("gate", "--artifact", str(loop), "--baseline", str(DEMO_MODEL)), "--artifact/--baseline", "Symlink loop")
    assert_refused(quantize("loadtest", "--model", str(loop)), str(loop), "--model", "Symlink loop")


def loadtest_model(world, name: str, config: bytes | None = None, *, tokenizer: bool = True) -> Path:
    folder = world.inputs / "loadtest-models" / name
    folder.mkdir(parents=True)
    if config is not None:
        (folder / "config.json").write_bytes(config)
    if tokenizer:
        (folder / "tokenizer.json").write_bytes((DEMO_MODEL / "tokenizer.json").read_bytes())
    return folder


def test_loadtest_names_a_model_folder_it_cannot_serve(world, quantize) -> None:
    as_list = loadtest_model(world, "config-list", b"[]")
    assert_refused(quantize("loadtest", "--model", str(as_list)), "config-list/config.json", "must be a JSON object")
    passwd = loadtest_model(world, "config-passwd")
    (passwd / "config.json").symlink_to("/etc/passwd")
    assert_refused(quantize("loadtest", "--model", str(passwd)), "config-passwd/config.json", "leads outside the model folder")
    untokenized = loadtest_model(world, "no-tokenizer", (DEMO_MODEL / "config.json").read_bytes(), tokenizer=False)
    assert_refused(quantize("loadtest", "--model", str(untokenized)), "no-tokenizer", "--model", "no tokenizer")


def test_loadtest_refuses_an_absurd_schema_valid_load_before_writing_anything(world, quantize) -> None:
    """min_requests 100000, requests_per_slot 1000, max_concurrency 2048: 4,068,000 workload lines (572 MB) before."""
    policy = write(world, "absurd-load.yaml", yaml_bytes(edited(POLICY, "performance.load",
                                                                {"min_requests": 100000, "requests_per_slot": 1000, "max_concurrency": 2048})))
    line = assert_refused(quantize("loadtest", "--model", str(DEMO_MODEL), "--policy", str(policy)), str(policy), "performance.load")
    assert "at most 200000" in line
    # the same load from the command line (a policy's own bounds passed): refused by the plan, before a run folder exists
    line = assert_refused(quantize("loadtest", "--model", str(DEMO_MODEL), "--artifact", str(DEMO_MODEL), "--concurrency", "4096",
                                   "--repeats", "50"))
    assert "performance.load" in line and "at most 200000" in line


def test_registry_list_creates_no_registry(world, quantize, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default registry of a root that has none: an empty answer and no file (before: registry.db, -wal, -shm)."""
    monkeypatch.setenv("QUANTGATE_REGISTRY", str(tmp_path / "root" / "registry.db"))
    code, out, err = quantize("registry", "list", "--json")
    assert code == 0 and json.loads(out) == [] and err == ""
    assert not (tmp_path / "root").exists()
    code, out, err = quantize("registry", "show", "demo-llama", "1")
    assert code == 2 and "unknown model" in err and not (tmp_path / "root").exists()
    assert_refused(quantize("registry", "list", "--registry", str(tmp_path / "root" / "registry.db")), "no registry database at this path")
    assert not (tmp_path / "root").exists()


def test_a_malformed_registry_row_is_named(world, quantize, tmp_path: Path) -> None:
    import shutil
    import sqlite3

    copy = tmp_path / "registry.db"
    shutil.copy(world.registry, copy)
    with sqlite3.connect(copy) as db:
        db.execute("DROP TRIGGER IF EXISTS events_no_update")
        db.execute("UPDATE versions SET eval_sets = '{not json'")
        db.execute("UPDATE events SET kind = 'exploded'")
    line = assert_refused(quantize("registry", "list", "--registry", str(copy)), str(copy), "versions", "version row 1 is malformed")
    assert "internal error" not in line
    assert_refused(quantize("registry", "history", "--registry", str(copy)), str(copy), "events", "an event row is malformed")


def test_a_half_written_model_folder_is_not_taken_as_complete(tmp_path: Path) -> None:
    from pipelines.errors import InputError
    from pipelines.models.catalog import add_model, is_complete

    folder = tmp_path / "smollm2-135m"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((DEMO_MODEL / name).read_bytes())
    weights = (DEMO_MODEL / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # the copy stopped half-way
    assert not is_complete(folder)
    with pytest.raises(InputError, match=r"exists but is not a complete model folder \(.*model.safetensors: safetensors: truncated"):
        add_model("smollm2-135m", models_dir=tmp_path)


def test_an_mlflow_file_store_address_is_named(world, quantize, tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    uri = f"file://{tmp_path}/mlruns"
    assert_refused(quantize("registry", "export-mlflow", "demo-llama", "1", "--tracking-uri", uri), uri, "--tracking-uri")
