"""The product's settings: the QUANTGATE_* environment, read when asked, never frozen at import.

    QUANTGATE_ROOT           the repository root (recipes/, eval_sets/, models/, policies/); default: this checkout
    QUANTGATE_ARTIFACTS      where runs, jobs, caches, logs and the registry go; default: <root>/artifacts
    QUANTGATE_REGISTRY       the registry database: a SQLite file or a postgresql:// URL; default: <artifacts>/registry.db
    QUANTGATE_SERVE_VENV     the serve environment holding vLLM; default: <root>/.venv-serve
    QUANTGATE_SERVE_TARGET   the serve target (`cpu`, `cuda:8.9`); default: the installed vLLM build's
    QUANTGATE_SERVE_FLAVOR   the vLLM build scripts/setup_env.sh installs (`cpu`, `cuda`)
    QUANTGATE_EVAL_SETS      the folder of business eval sets; default: <root>/eval_sets
    QUANTGATE_NGINX          the nginx binary `quantize serve` runs; default: nginx on PATH or in /usr/sbin
    QUANTGATE_MLFLOW         an MLflow tracking server promotions, alias moves and rollbacks are mirrored to
                             (pipelines.registry.mirror; `--mlflow URL` wins); default: no mirror

`current()` reads the environment at the moment it is called: a test or a job that sets a variable after
the package was imported is obeyed. An empty variable counts as unset.
"""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict

PACKAGE_ROOT = Path(__file__).resolve().parent.parent


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="QUANTGATE_", env_ignore_empty=True, extra="ignore", frozen=True)

    root: Path = PACKAGE_ROOT
    artifacts: Path | None = None
    registry: Path | None = None
    serve_venv: Path | None = None
    llamacpp_venv: Path | None = None
    serve_target: str | None = None
    serve_flavor: str | None = None
    eval_sets: Path | None = None
    nginx: str | None = None
    mlflow: str | None = None

    @property
    def artifacts_dir(self) -> Path:
        return self.artifacts or self.root / "artifacts"

    @property
    def registry_path(self) -> Path:
        return self.registry or self.artifacts_dir / "registry.db"

    @property
    def runs_dir(self) -> Path:
        return self.artifacts_dir / "runs"

    @property
    def jobs_dir(self) -> Path:
        return self.artifacts_dir / "jobs"

    @property
    def logs_dir(self) -> Path:
        return self.artifacts_dir / "logs"

    @property
    def baseline_cache_dir(self) -> Path:
        return self.artifacts_dir / "cache" / "baseline"

    @property
    def serve_venv_dir(self) -> Path:
        return self.serve_venv or self.root / ".venv-serve"

    @property
    def serve_python(self) -> Path:
        return self.serve_venv_dir / "bin" / "python"

    @property
    def llamacpp_python(self) -> Path:
        """llama-cpp-python's environment (scripts/setup_env.sh llamacpp): the CPU peer `make bench-speed` measures."""
        return (self.llamacpp_venv or self.root / ".venv-llamacpp") / "bin" / "python"

    @property
    def eval_sets_dir(self) -> Path:
        return self.eval_sets or self.root / "eval_sets"


def current() -> Settings:
    """The settings as the environment says now."""
    return Settings()
