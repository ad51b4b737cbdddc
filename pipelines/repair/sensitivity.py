"""How much quantizing each unit moves the model's outputs on the business prompts, and the ranking the search uses.

Two measures (pipelines.repair.simulate says how each is computed):
- proxy: the relative output error of every unit, at its current scheme and at each rung it could move to, on
  the calibration texts the quantize step would use (else the eval sets' held-out prompts): one forward pass.
- KL: the gate's yardstick, one unit fake-quantized at a time, teacher-forced on the baseline's own reference
  paths (the exact token ids the gate's KL uses, read from the baseline cache), else on greedy continuations
  made here by the 16-bit model. Measured for the `kl_top` units the proxy ranks first (all of them when there
  are few): the KL confirms the top of the proxy's list.

The search ranks by KL where measured, then by the proxy; per rung it estimates a unit's KL as its measured KL
scaled by the proxy's error ratio between the rung and the current scheme. Both rankings are reported with
their Spearman rank correlation (scipy), and the KL ranking's split-half agreement (even vs odd prompts).

Cached under artifacts/cache/sensitivity/<key>.json, the key hashing the model's files, the recipe as written,
the ladder, the reference paths, the calibration texts, the settings and the library versions. Predictions
of whole proposals (the KL of an assignment) are cached beside it, one entry per assignment.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipelines.console.output import progress
from pipelines.console.progress import track
from pipelines.errors import InputError
from pipelines.evaluation import baseline as baseline_cache
from pipelines.evaluation.divergence import MAX_NEW_TOKENS
from pipelines.evaluation.evalsets import EvalSet
from pipelines.evaluation.evaluate import load_prompts, materialize_tasks
from pipelines.files.atomic import write_json_atomic
from pipelines.files.hashing import folder_hash, sha256_json, sha256_text
from pipelines.quantize.calibration import calibration_inputs, draw_prompts, texts_sha256
from pipelines.quantize.compiler import gptq_settings, scheme_summary
from pipelines.recipe import FROM_EVAL_SETS, Calibration, GroupScheme, Recipe
from pipelines.repair.ladder import UnitLadder
from pipelines.repair.units import Assignment, RefPath, Unit
from pipelines.serve.serving import ServeSettings
from pipelines.settings import current as current_settings

SENSITIVITY_VERSION = 2  # 2: GPTQ rungs measured with GPTQ applied
LIBRARIES = ("torch", "transformers", "llmcompressor", "compressed-tensors")
NEAR_TIE_NATS = 0.5  # top-2 log-probability margin of a near-tie (odds under 1.65 : 1)


class SensitivitySettings(BaseModel):
    """How much the sensitivity pass measures. 48 prompts x up to 8 positions rank units stably (the report
    gives the split-half agreement) at a cost that grows with prompts x units measured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts: int = Field(default=48, ge=4, le=4096, description="reference paths the KL is measured on, drawn in turn from each set")
    kl_top: int = Field(default=16, ge=1, le=100_000, description="units whose KL is measured (the proxy's top)")
    proxy_texts: int = Field(default=64, ge=1, le=4096, description="calibration texts for the proxy when the recipe names none")
    max_seq_length: int = Field(default=256, ge=8, le=8192)
    seed: int = 0


class UnitSensitivity(BaseModel):
    unit: str
    layer: int
    kind: str
    scheme: str
    parameters: int
    proxy: dict[str, float] = Field(description="relative output error at the current scheme (first) and each rung above it")
    kl: float | None = Field(default=None, description="mean per-token KL with only this unit quantized; None: not measured")
    gptq_s: float | None = Field(default=None, description="seconds of GPTQ solves for this unit's GPTQ schemes (None: it has none)")
    kl_halves: list[float] | None = Field(default=None, description="the same on even and on odd prompts")


class Sensitivity(BaseModel):
    key: str
    reference_source: Literal["baseline cache", "16-bit greedy paths"]
    prompts: int
    positions: int
    proxy_source: str
    proxy_texts: int
    smoothquant: bool
    units: list[UnitSensitivity] = Field(description="in the order the search uses: KL-measured units by KL, then the rest by proxy")
    spearman: float | None = Field(default=None, description="rank correlation of proxy and KL over the units whose KL was measured")
    spearman_p: float | None = None
    split_half: float | None = Field(default=None, description="rank correlation of the KL on even vs odd prompts")
    kl_parent: float = Field(description="KL of the rejected recipe as a whole, simulated")
    calibration_samples: int = Field(default=0, description="samples of the calibration pass (static scales, GPTQ Hessians)")
    wall_s: dict[str, float] = Field(description="inputs, load (the model, smoothing, the calibration pass), gptq, proxy, kl, total")
    cached: bool = False

    def by_unit(self) -> dict[str, UnitSensitivity]:
        return {entry.unit: entry for entry in self.units}

    def estimated_kl(self, unit: str, scheme: GroupScheme | None) -> float:
        """A unit's KL at `scheme`, estimated: measured KL (or the proxy times the median KL/proxy ratio)
        scaled by the proxy's error ratio between `scheme` and the current scheme; 0 for 16-bit."""
        if scheme is None:
            return 0.0
        entry = self.by_unit()[unit]
        current = entry.proxy[entry.scheme]
        ratio = entry.proxy[scheme_summary(scheme)] / current if current > 0 else 0.0
        kl = entry.kl if entry.kl is not None else current * self.kl_per_proxy()
        return kl * ratio

    def kl_per_proxy(self) -> float:
        ratios = [e.kl / e.proxy[e.scheme] for e in self.units if e.kl is not None and e.proxy[e.scheme] > 0]
        return statistics.median(ratios) if ratios else 0.0


# ------------------------------------------------------------------------------------ inputs


def cached_baselines(model_dir: Path, eval_sets: list[EvalSet], serve: ServeSettings, cache_dir: Path) -> dict[str, baseline_cache.BaselineEntry]:
    """The gate's baseline cache entries of these sets (scores and reference paths), by set; sets without one are left out.
    Nothing on a machine without a serve environment (the GPU machine has no vLLM): the cache's keys name its versions, so
    nothing there was cached, and the pass makes its reference paths with the 16-bit model."""
    if not current_settings().serve_python.exists():
        return {}
    model_hash = folder_hash(model_dir)
    loaded = {s.name: baseline_cache.load_cached(baseline_cache.cache_key(model_hash, s, serve), cache_dir) for s in eval_sets}
    return {name: entry for name, entry in loaded.items() if entry is not None}


def near_tie_shares(entries: dict[str, baseline_cache.BaselineEntry]) -> dict[str, float]:
    """Per set, the share of items whose baseline answer starts on a near-tie: the 16-bit model's own top two
    first tokens within NEAR_TIE_NATS. Such items flip together under a perturbation too small for the KL to
    show (SmolLM2 on retail_order_id: 31% of items, the choice between the worked example's order number and
    the message's), so such a set's score swings between proposals whatever their simulated KL."""
    shares = {}
    for name, entry in entries.items():
        firsts = [sorted(r.baseline_topk[0].values(), reverse=True)[:2] for r in entry.references if r.baseline_topk]
        margins = [top[0] - top[1] for top in firsts if len(top) == 2]
        if margins:
            shares[name] = round(sum(m < NEAR_TIE_NATS for m in margins) / len(margins), 4)
    return shares


def reference_paths(model_dir: Path, eval_sets: list[EvalSet], entries: dict[str, baseline_cache.BaselineEntry],
                    settings: SensitivitySettings) -> tuple[list[RefPath], str]:
    """`settings.prompts` reference paths drawn in turn from each set: the baseline's own (baseline cache)
    when every set has an entry, else greedy continuations of the sets' prompts made by the 16-bit model."""
    if len(entries) == len(eval_sets):
        pool = {name: {r.doc_id: RefPath(eval_set=name, doc_id=r.doc_id, prompt_ids=r.prompt_ids, generated_ids=r.generated_ids)
                       for r in entry.references if r.generated_ids} for name, entry in entries.items()}
        return _draw(pool, settings), "baseline cache"

    prompts = _prompt_ids(model_dir, eval_sets)
    drawn = _draw({name: {doc: (name, doc, ids) for doc, ids in docs.items()} for name, docs in prompts.items()}, settings)
    progress(f"repair: no cached baseline paths; generating {len(drawn)} with the 16-bit model")
    from pipelines.repair.simulate import greedy_paths  # heavy: torch, imported when used

    return greedy_paths(model_dir, drawn, MAX_NEW_TOKENS), "16-bit greedy paths"


Drawn = TypeVar("Drawn")


def _draw(pool: dict[str, dict[int, Drawn]], settings: SensitivitySettings) -> list[Drawn]:
    keys = {name: [f"{name}\x00{doc}" for doc in sorted(docs)] for name, docs in pool.items()}
    drawn = draw_prompts(keys, settings.prompts, settings.seed)
    return [pool[name][int(doc)] for name, doc in (key.split("\x00") for key in drawn)]


def _prompt_ids(model_dir: Path, eval_sets: list[EvalSet]) -> dict[str, dict[int, list[int]]]:

    from transformers import AutoTokenizer  # heavy: imported when used


    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    scratch = current_settings().artifacts_dir / "tmp"  # the tasks and the datasets cache: under the artifacts root
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="quantgate-repair-", dir=scratch) as folder:
        include_dir = materialize_tasks(eval_sets, Path(folder) / "tasks")
        return {
            s.name: {p.doc_id: tokenizer(p.text, add_special_tokens=not s.chat_template)["input_ids"]
                     for p in load_prompts(s, include_dir, model_dir)}
            for s in eval_sets
        }


def proxy_texts(recipe: Recipe, calibration: str | None, eval_sets: list[EvalSet], model_dir: Path, settings: SensitivitySettings,
                calibrated_rungs: bool = False) -> tuple[list[str], str]:
    """The texts the quantize step calibrates on: the recipe's, or, for a recipe that calibrates nothing but whose
    rungs do (GPTQ, static scales), those of the default `calibration:` its proposals get (pipelines.repair.proposal);
    else the eval sets' held-out prompts (`from-eval-sets`), else none (the proxy then runs on the reference prompts)."""
    if recipe.needs_calibration or calibrated_rungs:
        texts, record = calibration_inputs(recipe.calibration or Calibration(), source=calibration, eval_sets=eval_sets, model_dir=model_dir)
        return texts, record.dataset if record else "none"
    try:
        texts, record = calibration_inputs(Calibration(dataset=FROM_EVAL_SETS, num_samples=settings.proxy_texts, seed=settings.seed),
                                           eval_sets=eval_sets)
    except InputError:
        return [], "the reference prompts"
    return texts, record.dataset if record else "none"


# ----------------------------------------------------------------------------------- the cache


def cache_key(model_dir: Path, recipe_text: str, ladder_text: str, paths: list[RefPath], texts: list[str],
              settings: SensitivitySettings) -> str:
    """The calibration is keyed by its texts, not by its name: a recipe that calibrates nothing measures the same
    whether a run named `--calibration` or not (`quantize --repair` and `quantize repair RUN_ID` share the cache)."""
    return sha256_json({
        "version": SENSITIVITY_VERSION,
        "model": folder_hash(model_dir),
        "recipe": sha256_text(recipe_text),
        "ladder": sha256_text(ladder_text),
        "paths": sha256_json([p.model_dump() for p in paths]),
        "texts": texts_sha256(texts),
        "settings": settings.model_dump(),
        "libraries": {name: version(name) for name in LIBRARIES},
    })


def _load(path: Path) -> Sensitivity | None:
    try:
        return Sensitivity.model_validate_json(path.read_text())
    except (OSError, ValidationError, json.JSONDecodeError):
        return None  # missing or corrupt: measured again, never trusted


# ----------------------------------------------------------------------------------- measuring


class SensitivityModel:
    """The sensitivity of one (model, recipe), and predictions of whole assignments (the simulator is loaded
    only when something is not cached)."""

    def __init__(self, model_dir: Path, recipe: Recipe, recipe_text: str, units: list[Unit], ladders: dict[str, UnitLadder],
                 eval_sets: list[EvalSet], serve: ServeSettings, cache_dir: Path, ladder_text: str,
                 settings: SensitivitySettings | None = None, calibration: str | None = None):
        self.model_dir, self.recipe, self.units, self.ladders = model_dir, recipe, units, ladders
        self.settings, self.calibration = settings or SensitivitySettings(), calibration
        started = time.monotonic()
        baselines = cached_baselines(model_dir, eval_sets, serve, baseline_cache_dir(cache_dir))
        self.paths, self.source = reference_paths(model_dir, eval_sets, baselines, self.settings)
        self.near_ties = near_tie_shares(baselines)
        self.calibrated_rungs = any(o.scheme is not None and o.scheme.needs_calibration for x in ladders.values() for o in x.options)
        self.texts, self.text_source = proxy_texts(recipe, calibration, eval_sets, model_dir, self.settings, self.calibrated_rungs)
        self.key = cache_key(model_dir, recipe_text, ladder_text, self.paths, self.texts, self.settings)
        self.folder = cache_dir
        self.inputs_s = round(time.monotonic() - started, 2)
        self._simulator = None
        self._predictions: dict[str, float] = self._read_predictions()
        self.simulations = 0

    @property
    def path(self) -> Path:
        return self.folder / f"{self.key}.json"

    def measure(self) -> Sensitivity:
        cached = _load(self.path)
        if cached is not None:
            progress(f"repair: sensitivity of {len(cached.units)} modules cached ({self.path.name[:12]}...)")
            return cached.model_copy(update={"cached": True})
        result = self._measure()
        write_json_atomic(self.path, result.model_dump(mode="json"))
        return result

    def _schemes(self) -> dict[str, list[GroupScheme]]:
        return {u.name: [s for s in (u.scheme, *(o.scheme for o in self.ladders[u.name].options)) if s is not None] for u in self.units}

    def simulator(self):
        if self._simulator is None:
            self._simulator = self._load_simulator()
        return self._simulator

    def _load_simulator(self):
        from transformers import AutoTokenizer  # heavy: imported when used


        progress(f"repair: loading {self.model_dir.name} in float32 for fake quantization")
        from pipelines.repair.simulate import Simulator  # heavy: torch, imported when used

        simulator = Simulator(self.model_dir, self.units, gptq_settings(self.recipe))
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        simulator.set_reference(self.paths)  # the 16-bit model, before any smoothing, is the reference
        if self.recipe.smoothquant is not None:
            simulator.smooth(self.recipe.smoothquant.strength, self.texts, tokenizer, self._max_length())
        encoded = self._encoded(tokenizer)
        with track("repair: calibration pass (static scales, GPTQ Hessians)", total=len(encoded), unit="sample") as bar:
            simulator.calibrate(encoded, self._schemes(), bar.advance)
        return simulator

    def _max_length(self) -> int:
        if self.recipe.calibration is not None or self.calibrated_rungs:
            return (self.recipe.calibration or Calibration()).max_seq_length
        return self.settings.max_seq_length

    def _encoded(self, tokenizer) -> list[list[int]]:
        if not self.texts:
            return [p.prompt_ids for p in self.paths]
        return [tokenizer(text, truncation=True, max_length=self._max_length())["input_ids"] for text in self.texts]

    def _measure(self) -> Sensitivity:
        from transformers import AutoTokenizer  # heavy: imported when used

        started = time.monotonic()
        simulator = self.simulator()
        loaded = time.monotonic()
        schemes = self._schemes()
        self._solve_gptq(simulator, schemes)
        solved = time.monotonic()
        progress(f"repair: proxy error of {len(self.units)} modules x {sum(map(len, schemes.values()))} schemes on "
                 f"{len(self.texts) or len(self.paths)} texts")
        proxy = simulator.proxy(self._encoded(AutoTokenizer.from_pretrained(self.model_dir)), schemes)
        proxied = time.monotonic()
        entries = [self._entry(unit, proxy[unit.name], simulator.gptq_s.get(unit.name)) for unit in self.units]
        top = sorted(entries, key=lambda e: e.proxy[e.scheme], reverse=True)[: self.settings.kl_top]
        with track(f"repair: KL of the top modules, one at a time, on {len(self.paths)} reference paths", total=len(top), unit="module") as bar:
            for entry in top:
                kl = simulator.kl({entry.unit: self._unit(entry.unit).scheme})
                entry.kl, entry.kl_halves = kl.mean, [_mean(kl.items[0::2]), _mean(kl.items[1::2])]
                bar.advance()
        parent = simulator.kl({u.name: u.scheme for u in self.units}).mean
        measured = time.monotonic()
        ranked = sorted(entries, key=lambda e: (e.kl is None, -(e.kl if e.kl is not None else e.proxy[e.scheme])))
        rho, p_value, halves = _agreement(entries)
        return Sensitivity(
            key=self.key, reference_source=self.source, prompts=len(self.paths),
            positions=sum(len(p.generated_ids) for p in self.paths), proxy_source=self.text_source,
            proxy_texts=len(self.texts) or len(self.paths), smoothquant=self.recipe.smoothquant is not None, units=ranked,
            spearman=rho, spearman_p=p_value, split_half=halves, kl_parent=parent, calibration_samples=len(self.texts),
            wall_s={"inputs": self.inputs_s, "load": round(loaded - started, 2), "calibration": round(simulator.calibration_s, 2),
                    "gptq": round(solved - loaded, 2),
                    "proxy": round(proxied - solved, 2), "kl": round(measured - proxied, 2),
                    "total": round(self.inputs_s + measured - started, 2)},
        )

    def _solve_gptq(self, simulator, schemes: dict[str, list[GroupScheme]]) -> None:
        """Every unit's GPTQ schemes solved once up front (llm-compressor's solver, cached in the simulator), with progress:
        the proxy and the KL then read them."""
        work = [(unit, scheme) for unit in self.units for scheme in schemes[unit.name] if scheme.algorithm == "gptq"]
        if not work:
            return
        with track("repair: GPTQ on each module's GPTQ rungs", total=len(work), unit="solve") as bar:
            for unit, scheme in work:
                simulator.prepare({unit.name: scheme})
                bar.advance()

    def _unit(self, name: str) -> Unit:
        return next(unit for unit in self.units if unit.name == name)

    def _entry(self, unit: Unit, errors: dict[GroupScheme, float], gptq_s: float | None) -> UnitSensitivity:
        return UnitSensitivity(
            unit=unit.name, layer=unit.layer, kind=unit.kind, scheme=scheme_summary(unit.scheme), parameters=unit.parameters,
            proxy={scheme_summary(scheme): round(error, 10) for scheme, error in errors.items()},
            gptq_s=round(gptq_s, 3) if gptq_s is not None else None,
        )

    # --------------------------------------------------------------------------------- predictions

    @property
    def _predictions_path(self) -> Path:
        return self.folder / f"{self.key}.predictions.json"

    def _read_predictions(self) -> dict[str, float]:
        try:
            data = json.loads(self._predictions_path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}

    def predict(self, assignment: Assignment) -> float:
        """Simulated KL of the model with every unit at its assigned scheme (units not named: 16-bit)."""
        key = sha256_json(sorted((name, scheme_summary(scheme)) for name, scheme in assignment.items()))
        if key not in self._predictions:
            started = time.monotonic()
            self._predictions[key] = round(self.simulator().kl(assignment).mean, 10)
            write_json_atomic(self._predictions_path, self._predictions)
            self.simulations += 1
            progress(f"repair: simulation {self.simulations} (a whole proposal fake-quantized): KL {self._predictions[key]:.3g} "
                     f"in {time.monotonic() - started:.0f} s")
        return self._predictions[key]


def baseline_cache_dir(sensitivity_dir: Path) -> Path:
    return sensitivity_dir.parent / "baseline"


def sensitivity_dir(baseline_dir: Path) -> Path:
    """artifacts/cache/sensitivity beside the gate's baseline cache (artifacts/cache/baseline)."""
    return baseline_dir.parent / "sensitivity"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _agreement(entries: list[UnitSensitivity]) -> tuple[float | None, float | None, float | None]:
    """Spearman of proxy vs KL, and of KL on even vs odd prompts, over the units whose KL was measured."""
    from scipy.stats import spearmanr  # heavy: imported when used

    measured = [e for e in entries if e.kl is not None and e.kl_halves is not None]
    if len(measured) < 3:
        return None, None, None
    proxy = spearmanr([e.proxy[e.scheme] for e in measured], [e.kl for e in measured])
    halves = spearmanr(*zip(*(e.kl_halves or (0.0, 0.0) for e in measured), strict=True))
    return _finite(proxy.statistic), _finite(proxy.pvalue), _finite(halves.statistic)


def _finite(value: float) -> float | None:

    return round(float(value), 4) if value is not None and math.isfinite(value) else None
