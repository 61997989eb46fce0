"""Pre-flight check of the experiment trackers a run logs to (``trainer.logging.loggers``: wandb, mlflow).

A tracker that cannot start fails here, before anything heavy loads (exit code 2, one line naming the key), not at
the first step: the package is missing, the mode or tracking URI is not one the library takes, the folder it would
write cannot be created, or the server of an online mode cannot be reached. What a section leaves unset is resolved
as the library resolves it (:func:`wandb_mode`, :func:`mlflow_uri`: the ``WANDB_*`` / ``MLFLOW_*`` environment
variables, then the library's default), so the check sees what the run will use.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from alignopsd.engine.config.errors import ConfigError
from alignopsd.engine.config.trainer_section import MlflowConfig, TrainerConfig, WandbConfig

PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}  # logger -> the module it imports
WANDB_MODES = ("online", "offline", "disabled", "dryrun")
WANDB_SERVER = "https://api.wandb.ai"
PROBE_TIMEOUT_S = 5.0


def wandb_mode(section: WandbConfig, env: Mapping[str, str]) -> str:
    """The mode a W&B run takes: the section's, else WANDB_MODE, else online."""
    return section.mode or env.get("WANDB_MODE", "").strip().lower() or "online"


def wandb_dir(section: WandbConfig, env: Mapping[str, str], out_dir: Path) -> Path:
    """Where wandb writes its files: the section's ``dir``, else WANDB_DIR, else the run's output folder."""
    return Path(section.dir or env.get("WANDB_DIR") or out_dir).expanduser()


def mlflow_uri(section: MlflowConfig, env: Mapping[str, str]) -> str | None:
    """The tracking URI: the section's, else MLFLOW_TRACKING_URI; None leaves it to MLflow's default."""
    return section.tracking_uri or env.get("MLFLOW_TRACKING_URI") or None


def _reach(url: str) -> str | None:
    """None when a TCP connection to the URL's host opens; else why not."""
    parsed = urlparse(url)
    if not parsed.hostname:
        return f"{url!r} names no host"
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=PROBE_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"{parsed.hostname}:{port} cannot be reached ({exc.strerror or exc})"


def _writable(path: Path) -> bool:
    """``path`` exists as a writable folder, or its nearest existing parent is one (so it can be created)."""
    p = path.resolve()
    while not p.exists():
        p = p.parent
    return p.is_dir() and os.access(p, os.W_OK | os.X_OK)


def check_wandb(section: WandbConfig, env: Mapping[str, str], out_dir: Path) -> None:
    mode = wandb_mode(section, env)
    if mode not in WANDB_MODES:
        raise ConfigError(
            f"WANDB_MODE: unknown value {mode!r} (trainer.logging.wandb.mode unset); allowed: online, offline, disabled"
        )
    folder = wandb_dir(section, env, out_dir)
    if mode != "disabled" and not _writable(folder):
        raise ConfigError(
            f"trainer.logging.wandb.dir: {str(folder)!r} cannot be written (the section's dir, else WANDB_DIR)"
        )
    if mode == "online":
        server = env.get("WANDB_BASE_URL") or WANDB_SERVER
        why = _reach(server)
        if why:
            raise ConfigError(
                f"trainer.logging.wandb.mode: online, but the W&B server {server} is out of reach: {why}; log offline "
                "(trainer.logging.wandb.mode=offline or WANDB_MODE=offline) and `wandb sync` later"
            )


def check_mlflow(section: MlflowConfig, env: Mapping[str, str]) -> None:
    uri = mlflow_uri(section, env)
    key = "trainer.logging.mlflow.tracking_uri" if section.tracking_uri else "MLFLOW_TRACKING_URI"
    if uri is not None:
        scheme = urlparse(uri).scheme
        if scheme in ("http", "https"):
            why = _reach(uri)
            if why:
                raise ConfigError(f"{key}: {uri!r}: the tracking server is out of reach: {why}")
        elif scheme in ("", "file") and not _writable(Path(urlparse(uri).path if scheme else uri)):
            raise ConfigError(f"{key}: {uri!r}: the folder of the file store cannot be written")
    from mlflow import MlflowClient  # resolves the store: an unknown scheme or a refused store raises here

    try:
        MlflowClient(tracking_uri=uri)
    except Exception as exc:  # MlflowException and the registry's own errors
        where = f"{key}: {uri!r}" if uri is not None else "MLflow's default tracking URI"
        raise ConfigError(f"{where}: {' '.join(str(exc).split())}") from None


def check_loggers(trainer: TrainerConfig, out_dir: Path, env: Mapping[str, str]) -> None:
    """Every tracker of ``trainer.logging.loggers`` can start on this machine; ConfigError naming the key otherwise."""
    for name in trainer.logging.loggers:
        module = PACKAGES.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"trainer.logging.loggers: {name!r} needs the {module} package, which is not installed "
                f"(pip install 'alignopsd[{name}]')"
            )
    if "wandb" in trainer.logging.loggers:
        check_wandb(trainer.logging.wandb, env, out_dir)
    if "mlflow" in trainer.logging.loggers:
        check_mlflow(trainer.logging.mlflow, env)
