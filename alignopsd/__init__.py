"""AlignOPSD: the method as pure tensor functions (no models, no I/O).

Public names follow the project's API card; they are imported lazily so that importing
``alignopsd`` stays cheap and the engine can import one piece without the rest.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # outcome advantage
    "grpo_advantage": "advantage",
    "invalid_action_residual": "advantage",
    # mechanism 1
    "eligibility": "selection",
    "select_sources": "selection",
    "action_filter": "actions",
    "rectify": "rectification",
    "Rectified": "rectification",
    "similarity_matrix": "selection",
    "pairs_from_selection": "selection",
    "cross_inputs": "rectification",
    "policy_mask": "rectification",
    # mechanism 2
    "correspondence_profiles": "profiles",
    "boundary_scores": "profiles",
    "segmentation_threshold": "profiles",
    "segment": "segmentation",
    "segment_random": "segmentation",
    "project_to_box": "projection",
    "allocate_credit": "credit",
    "Credit": "credit",
    "CreditConfig": "credit_config",
    "Segmentation": "segmentation",
    # losses
    "ppo_loss": "losses",
    "low_var_kl": "losses",
    "entropy_bonus": "losses",
    "actor_loss": "losses",
    "alignment_loss": "losses",
    "sdar_loss": "losses",
    "token_mean": "losses",
    "microbatch_scales": "losses",
    "weighted_token_count": "losses",
    "auxiliary_loss": "losses",
    "AuxTerm": "losses",
    # canonical turns
    "canonicalize": "canonical",
    "Canonical": "canonical",
    # estimators and configuration
    "ESTIMATORS": "estimators",
    "get_estimator": "estimators",
    "register_estimator": "estimators",
    "EstimatorName": "estimators",
    "EstimatorSpec": "estimators",
    "EstimatorInputs": "estimator_io",
    "EstimatorOutput": "estimator_io",
    "AlgorithmConfig": "config",
    "RectifyConfig": "config",
    "AlignmentLossConfig": "config",
    "SdarConfig": "config",
    "RlsdConfig": "config",
    "OpsdConfig": "config",
    "PRESETS": "config",
    "get_preset": "config",
    "from_dict": "config",
    "to_dict": "config",
    "apply_overrides": "config",
    "override_mapping": "config",
    # model-free diagnostics
    "m1_diagnostics": "diagnostics",
    "paired_sign_flips": "diagnostics",
    "off_turn_match_weight": "diagnostics",
    "action_filter_metrics": "diagnostics",
    "formula_comparison": "diagnostics",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'alignopsd' has no attribute {name!r}")
    mod = importlib.import_module(f"alignopsd.{module}")
    value = getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
